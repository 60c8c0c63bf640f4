"""Long seeded random walks (thousands of operations, steady memory pressure) in lockstep.

Complements the hypothesis machine: fewer shrinkable cases but much longer histories, so
eviction, deduplication and stale cache entries get exercised deeply.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests.native.harness import Lockstep


def _prompt(rng: random.Random, block_size: int) -> list[int]:
    stem = [7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5, 2] * 4
    return stem[: rng.randrange(0, len(stem))] + [
        rng.randrange(3) for _ in range(rng.randrange(0, 3 * block_size))
    ]


def _step(h: Lockstep, rng: random.Random, next_id: int) -> int:
    ids = sorted(h.tokens)
    op = rng.choice(["add", "add", "append", "append", "batch", "fork", "truncate", "free", "mark"])
    if op == "add" or not ids:
        tokens = _prompt(rng, h.block_size)
        if h.call("add_sequence", next_id, tokens)[0] == "ok":
            h.tokens[next_id] = tokens
        return next_id + 1
    seq_id = rng.choice(ids)
    if op == "append":
        tail = [rng.randrange(3) for _ in range(rng.choice([1, 1, 1, 3, h.block_size + 1]))]
        start = len(h.tokens[seq_id])
        if h.call("append_tokens", seq_id, tail)[0] == "ok":
            h.tokens[seq_id] += tail
            h.assert_exclusive(seq_id, start, start + len(tail))
    elif op == "batch":
        batch = rng.sample(ids, min(len(ids), 4))
        tails = [[rng.randrange(3) for _ in range(rng.choice([0, 1, 2, h.block_size]))] for _ in batch]
        flat = [t for tail in tails for t in tail]
        if h.call("append_tokens_batch", batch, flat, [len(t) for t in tails])[0] == "ok":
            for seq_id, tail in zip(batch, tails, strict=True):
                h.tokens[seq_id] += tail
    elif op == "fork":
        h.call("fork", seq_id, next_id)
        h.tokens[next_id] = list(h.tokens[seq_id])
        return next_id + 1
    elif op == "truncate":
        n = rng.randrange(len(h.tokens[seq_id]) + 1)
        h.call("truncate", seq_id, n)
        h.tokens[seq_id] = h.tokens[seq_id][:n]
    elif op == "free":
        h.call("free", seq_id)
        del h.tokens[seq_id]
    else:
        batch = rng.sample(ids, min(len(ids), 3))
        nums = [rng.randrange(len(h.tokens[i]) + 1) for i in batch]
        h.call("mark_computed", np.array(batch, dtype=np.int64), np.array(nums, dtype=np.int32))
    return next_id


@pytest.mark.parametrize("seed", range(6))
def test_random_walk_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    h = Lockstep(num_blocks=rng.choice([16, 48]), block_size=rng.choice([2, 3, 4, 16]))
    next_id = 0
    for step in range(1500):
        next_id = _step(h, rng, next_id) % 190  # ids stay inside the harness's snapshot range
        while next_id in h.tokens:
            next_id = (next_id + 1) % 190
        if step % 25 == 0:
            h.check()
    h.check()
    stats = h.native.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["cow_copies"] > 0 and stats["evictions"] > 0
    for seq_id in list(h.tokens):
        h.call("free", seq_id)
    h.tokens.clear()
    h.check()
    assert h.native.stats()["used_blocks"] == 0
