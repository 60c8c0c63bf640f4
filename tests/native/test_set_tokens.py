"""set_tokens: placeholder ids in the middle of a sequence replaced in place, on both backends."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedinfer import _native
from pagedinfer.engine.core import block_pool_ref as ref
from pagedinfer.engine.core.kv_cache_manager import KVCacheManager
from tests.native.harness import Lockstep, snapshot
from tests.native.test_block_manager_random import _step

IMPLS = {"native": _native, "ref": ref}
PLACEHOLDER = -1


@pytest.fixture(params=sorted(IMPLS))
def impl(request):
    return IMPLS[request.param]


def i32(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def test_overwrites_middle_positions_without_moving_blocks(impl) -> None:
    bm = impl.BlockManager(8, 4)
    bm.add_sequence(1, [1, 2, 3, 4, 5, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER, 9, 10])
    table, free = bm.block_table(1).tolist(), bm.num_free_blocks
    bm.set_tokens(1, 5, i32(6, 7, 8))  # spans blocks 1 and 2
    assert bm.token_ids(1).tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert bm.block_table(1).tolist() == table and bm.num_free_blocks == free
    assert bm.block_tokens(table[1]).tolist() == [5, 6, 7, 8]
    assert bm.block_tokens(table[2]).tolist()[:2] == [9, 10]
    bm.set_tokens(1, 9, [11])  # a plain list works too
    assert bm.token_ids(1).tolist()[-1] == 11 and bm.num_tokens(1) == 10
    bm.check_invariants()


def test_prefix_cache_hashes_the_new_ids(impl) -> None:
    bm = impl.BlockManager(16, 4)
    bm.add_sequence(1, [1, 2, 3, 4, 5, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER, 9])
    bm.set_tokens(1, 5, [6, 7, 8])
    bm.mark_computed(np.array([1], dtype=np.int64), i32(8))
    assert bm.add_sequence(2, [1, 2, 3, 4, 5, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER, 0]) == 4
    assert bm.add_sequence(3, [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    assert bm.block_table(3).tolist()[:2] == bm.block_table(1).tolist()[:2]
    bm.check_invariants()


def _hashed(bm) -> None:
    bm.mark_computed(np.array([1], dtype=np.int64), i32(4))  # block 0 becomes prefix-cached


def _shared(bm) -> None:
    bm.fork(1, 2)  # every block of sequence 1 is shared


@pytest.mark.parametrize(
    ("setup", "seq_id", "start", "tokens", "error", "match"),
    [
        (None, 7, 0, [1], "unknown", "unknown sequence"),
        (None, 7, 0, [], "unknown", "unknown sequence"),
        (None, 1, -1, [1, 2], ValueError, "do not fit"),
        (None, 1, 9, [1, 2], ValueError, "do not fit"),
        (None, 1, 10, [1], ValueError, "do not fit"),
        (_hashed, 1, 3, [1, 2], ValueError, "prefix-cached"),
        (_shared, 1, 8, [1], ValueError, "shared"),
    ],
)
def test_errors_change_nothing(impl, setup, seq_id, start, tokens, error, match) -> None:
    bm = impl.BlockManager(8, 4)
    bm.add_sequence(1, list(range(10)))
    if setup is not None:
        setup(bm)
    before = snapshot(bm)
    with pytest.raises(impl.UnknownSequenceError if error == "unknown" else error, match=match):
        bm.set_tokens(seq_id, start, tokens)
    assert snapshot(bm) == before
    bm.check_invariants()


def test_unhashed_exclusive_blocks_after_a_hashed_one_can_change(impl) -> None:
    bm = impl.BlockManager(8, 4)
    bm.add_sequence(1, list(range(10)))
    _hashed(bm)
    bm.set_tokens(1, 4, [40, 50])  # block 1 is past the hashed block 0
    assert bm.token_ids(1).tolist()[3:7] == [3, 40, 50, 6]
    bm.set_tokens(1, 5, [])  # empty: a no-op
    assert bm.token_ids(1).tolist()[3:7] == [3, 40, 50, 6]
    bm.check_invariants()


def test_unregisters_a_truncated_cached_block(impl) -> None:
    bm = impl.BlockManager(8, 4)
    bm.add_sequence(1, list(range(8)))
    bm.mark_computed(np.array([1], dtype=np.int64), i32(8))
    bm.truncate(1, 6)  # block 1 stays cached, but no longer counts as hashed for sequence 1
    bm.set_tokens(1, 5, [42])
    bm.check_invariants()  # a stale registration fails the content-hash check
    assert bm.add_sequence(2, list(range(8))) == 4  # the old content of block 1 is gone


@pytest.mark.parametrize("seed", range(4))
def test_random_walk_with_set_tokens_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    h = Lockstep(num_blocks=32, block_size=rng.choice([2, 4]))
    next_id, outcomes = 0, {"ok": 0, "error": 0}
    for step in range(600):
        next_id = _step(h, rng, next_id) % 190  # ids stay inside the harness's snapshot range
        while next_id in h.tokens:
            next_id = (next_id + 1) % 190
        if not h.tokens:
            continue
        seq_id = rng.choice(sorted(h.tokens))
        length = len(h.tokens[seq_id])
        start = rng.randrange(length + 1)
        new = [rng.randrange(3) for _ in range(rng.randrange(min(length - start, 2 * h.block_size) + 1))]
        table = h.native.block_table(seq_id).tolist()
        status, _ = h.call("set_tokens", seq_id, start, np.array(new, dtype=np.int32))
        outcomes[status] += 1
        if status == "ok":
            h.tokens[seq_id][start : start + len(new)] = new
            assert h.native.block_table(seq_id).tolist() == table
        if step % 20 == 0:
            h.check()
    h.check()
    assert outcomes["ok"] > 0 and outcomes["error"] > 0


@pytest.mark.parametrize("backend", [None, ref.BlockManager], ids=["native", "ref"])
def test_kv_cache_manager_set_tokens(backend) -> None:
    kv = KVCacheManager(8, 4, backend_factory=backend)
    kv.allocate(1, [1, 2, 3, 4, 5, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER, 9])
    table = kv.block_table(1)
    kv.set_tokens(1, 5, [6, 7, 8])
    kv.set_tokens(1, 2, [])
    assert kv.block_table(1) == table and kv.num_tokens(1) == 9
    kv.mark_computed([1], [8])
    with pytest.raises(ValueError, match="prefix-cached"):
        kv.set_tokens(1, 7, [0])
    assert kv.allocate(2, [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    assert kv.allocate(3, [1, 2, 3, 4, 5, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER, 0]) == 4
