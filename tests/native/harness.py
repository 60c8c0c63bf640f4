"""Drives the native block manager and the Python reference in lockstep (shared by tests)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from pagedinfer import _native
from pagedinfer.engine.core import block_pool_ref as ref

ERRORS = {
    "oob": (_native.OutOfBlocksError, ref.OutOfBlocksError),
    "unknown": (_native.UnknownSequenceError, ref.UnknownSequenceError),
    "duplicate": (_native.DuplicateSequenceError, ref.DuplicateSequenceError),
}


def snapshot(bm) -> tuple:
    """Everything observable about a manager's state (for strong-exception-guarantee checks)."""
    seqs = {}
    for seq_id in range(-4, 200):
        if bm.has_sequence(seq_id):
            seqs[seq_id] = (bm.token_ids(seq_id).tolist(), bm.block_table(seq_id).tolist())
    refcounts = [bm.block_refcount(b) for b in range(bm.num_total_blocks)]
    return bm.stats(), seqs, refcounts


class Lockstep:
    """Applies each operation to both managers and checks they agree, op by op."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.native = _native.BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.ref = ref.BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.block_size = block_size
        self.tokens: dict[int, list[int]] = {}  # the model: what each sequence must hold

    def call(self, name: str, *args):
        """Same call on both; equal results, or the same kind of error with state unchanged."""
        before = snapshot(self.native)
        outcome = []
        for bm, side in ((self.native, 0), (self.ref, 1)):
            try:
                outcome.append(("ok", getattr(bm, name)(*args)))
            except Exception as e:  # classified below; anything unexpected fails the test
                kinds = [k for k, classes in ERRORS.items() if isinstance(e, classes[side])]
                kind = kinds[0] if kinds else type(e).__name__
                outcome.append(("error", kind))
        (status_n, value_n), (status_r, value_r) = outcome
        assert status_n == status_r and (status_n == "ok" or value_n == value_r), (name, args, outcome)
        if status_n == "error":
            assert snapshot(self.native) == before, f"{name} changed state before raising"
            return "error", value_n
        assert _plain(value_n) == _plain(value_r), (name, args, value_n, value_r)
        return "ok", value_n

    def check(self) -> None:
        """Invariants of both managers plus the properties the issue names."""
        self.native.check_invariants()
        self.ref.check_invariants()
        assert self.native.stats() == self.ref.stats()
        refs: Counter[int] = Counter()
        bs = self.block_size
        for seq_id, tokens in self.tokens.items():
            table = self.native.block_table(seq_id).tolist()
            assert table == self.ref.block_table(seq_id).tolist()
            assert self.native.token_ids(seq_id).tolist() == tokens
            # The blocks really hold the sequence's tokens (prefix reuse, COW, truncation).
            content = [t for b in table for t in self.native.block_tokens(b).tolist()][: len(tokens)]
            assert content == tokens, f"sequence {seq_id} reads wrong content"
            assert len(table) == -(-len(tokens) // bs)
            refs.update(table)
        for block in range(self.native.num_total_blocks):
            assert self.native.block_refcount(block) == refs[block]
        stats = self.native.stats()
        assert stats["used_blocks"] == len(refs)
        assert stats["free_blocks"] + stats["used_blocks"] + stats["cached_blocks"] == stats["total_blocks"]

    def assert_exclusive(self, seq_id: int, start: int, end: int) -> None:
        """Blocks that received writes at positions [start, end) belong to this sequence only."""
        table = self.native.block_table(seq_id).tolist()
        written = {table[p // self.block_size] for p in range(start, end)}
        for other, _ in self.tokens.items():
            if other != seq_id:
                assert not written & set(self.native.block_table(other).tolist())
        for block in written:
            assert self.native.block_refcount(block) == 1


def _plain(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "slot_mapping"):
        return {k: getattr(value, k).tolist() for k in _BATCH_FIELDS}
    return value


_BATCH_FIELDS = ("block_tables", "slot_mapping", "positions", "context_lens", "query_start_loc")
