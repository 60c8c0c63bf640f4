"""Property tests: long random operation sequences on the native core vs the Python reference.

After every step: identical results and block ids, refcounts equal page-table references,
every block is exactly one of free / in use / cached, sequences read back their own tokens from
their blocks, and blocks that receive writes are held by exactly one sequence. At teardown
everything is freed and no block leaks.
"""

from __future__ import annotations

import copy

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedinfer.engine.core import block_pool_ref as ref
from tests.native.harness import Lockstep

# A small alphabet and a few shared stems make prefix-cache hits (and collisions of content
# between unrelated sequences) frequent.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [1, 2, 3, 4, 9, 9, 9, 9], [5] * 20]
tokens_st = st.lists(st.integers(0, 3), max_size=20)


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(4, 40),
        block_size=st.sampled_from([1, 2, 3, 4, 4, 16]),
        enable_prefix_caching=st.booleans(),
    )
    def setup(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.h = Lockstep(num_blocks, block_size, enable_prefix_caching)
        self.next_id = 0

    def _existing(self, data) -> int:
        return data.draw(st.sampled_from(sorted(self.h.tokens)), label="seq_id")

    @rule(stem=st.sampled_from(STEMS), cut=st.integers(0, 20), tail=tokens_st)
    def add(self, stem: list[int], cut: int, tail: list[int]) -> None:
        tokens = stem[:cut] + tail
        seq_id, self.next_id = self.next_id, self.next_id + 1
        status, reused = self.h.call("add_sequence", seq_id, np.array(tokens, dtype=np.int32))
        if status == "ok":
            self.h.tokens[seq_id] = tokens
            assert reused % self.h.block_size == 0 and reused <= len(tokens)

    @precondition(lambda self: self.h.tokens)
    @rule(data=st.data(), tail=tokens_st)
    def append(self, data, tail: list[int]) -> None:
        self.append_tail(self._existing(data), tail)

    def append_tail(self, seq_id: int, tail: list[int]) -> None:
        need = self.h.call("blocks_needed_to_append", seq_id, len(tail))[1]
        free_before = self.h.native.num_free_blocks
        start = len(self.h.tokens[seq_id])
        status, copies = self.h.call("append_tokens", seq_id, tail)
        assert (status == "ok") == (need <= free_before)
        if status == "ok":
            assert free_before - self.h.native.num_free_blocks == need
            assert len(copies) <= 1
            self.h.tokens[seq_id] = self.h.tokens[seq_id] + tail
            self.h.assert_exclusive(seq_id, start, start + len(tail))

    @precondition(lambda self: self.h.tokens)
    @rule(data=st.data())
    def append_batch(self, data) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.h.tokens)), min_size=1, max_size=4))
        tails = [data.draw(tokens_st.map(lambda t: t[:6])) for _ in ids]
        counts = [len(t) for t in tails]
        bs = self.h.block_size
        new_blocks = sum(
            -(-(len(self.h.tokens[i]) + n) // bs) - -(-len(self.h.tokens[i]) // bs)
            for i, n in zip(ids, counts, strict=True)
        )
        sequential = copy.deepcopy(self.h.ref)  # what one append per sequence would do
        free_before = self.h.native.num_free_blocks
        need_status, need = self.h.call("blocks_needed_to_append_batch", ids, counts)
        status, copies = self.h.call("append_tokens_batch", ids, [t for tail in tails for t in tail], counts)
        if len(set(ids)) != len(ids):
            assert status == "error" and need_status == "error"
            return
        assert need_status == "ok" and (status == "ok") == (need <= free_before)
        try:
            for seq_id, tail in zip(ids, tails, strict=True):
                sequential.append_tokens(seq_id, tail)
            fits = True
        except ref.OutOfBlocksError:
            fits = False
        assert (status == "ok") == fits  # the batch pre-check is exact, not conservative
        if status == "ok":
            assert free_before - self.h.native.num_free_blocks == new_blocks + len(copies) == need
            for seq_id, tail in zip(ids, tails, strict=True):
                start = len(self.h.tokens[seq_id])
                self.h.tokens[seq_id] = self.h.tokens[seq_id] + tail
                self.h.assert_exclusive(seq_id, start, start + len(tail))
                assert sequential.block_table(seq_id).tolist() == self.h.ref.block_table(seq_id).tolist()

    @precondition(lambda self: self.h.tokens)
    @rule(data=st.data())
    def set_last_tokens(self, data) -> None:
        """Placeholders resolved late (async scheduling): allowed only in an exclusive, unhashed
        last block; both implementations accept or refuse the same calls."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.h.tokens)), min_size=1, max_size=3))
        new = [data.draw(st.integers(0, 3)) for _ in ids]
        args = (np.array(ids, dtype=np.int64), np.array(new, dtype=np.int32))
        status, _ = self.h.call("set_last_tokens", *args)
        if status == "ok":
            assert len(set(ids)) == len(ids)
            for seq_id, token in zip(ids, new, strict=True):
                self.h.tokens[seq_id] = [*self.h.tokens[seq_id][:-1], token]

    @precondition(lambda self: self.h.tokens)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = self._existing(data)
        child, self.next_id = self.next_id, self.next_id + 1
        assert self.h.call("fork", parent, child) == ("ok", None)
        self.h.tokens[child] = list(self.h.tokens[parent])

    @precondition(lambda self: self.h.tokens)
    @rule(data=st.data(), frac=st.floats(0, 1.2))
    def truncate(self, data, frac: float) -> None:
        seq_id = self._existing(data)
        n = int(len(self.h.tokens[seq_id]) * frac)
        status, copies = self.h.call("truncate", seq_id, n)
        assert (status == "ok") == (n <= len(self.h.tokens[seq_id]))
        if status == "ok":
            assert copies == []
            self.h.tokens[seq_id] = self.h.tokens[seq_id][:n]

    @precondition(lambda self: self.h.tokens)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq_id = self._existing(data)
        assert self.h.call("free", seq_id) == ("ok", None)
        del self.h.tokens[seq_id]
        assert self.h.call("free", seq_id) == ("error", "unknown")  # double free

    @precondition(lambda self: self.h.tokens)
    @rule(data=st.data())
    def mark_computed(self, data) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.h.tokens)), min_size=1, max_size=4))
        nums = [data.draw(st.integers(0, len(self.h.tokens[i]))) for i in ids]
        args = (np.array(ids, dtype=np.int64), np.array(nums, dtype=np.int32))
        assert self.h.call("mark_computed", *args) == ("ok", None)

    @precondition(lambda self: self.h.tokens)
    @rule(data=st.data())
    def build_batch(self, data) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.h.tokens)), min_size=1, max_size=4))
        computed, new = [], []
        for i in ids:
            n = len(self.h.tokens[i])
            computed.append(data.draw(st.integers(0, n)))
            new.append(data.draw(st.integers(0, n - computed[-1] + 1)))  # +1: sometimes invalid
        status, _ = self.h.call("build_batch", ids, computed, new)
        valid = all(c + k <= len(self.h.tokens[i]) for i, c, k in zip(ids, computed, new, strict=True))
        assert (status == "ok") == valid

    @precondition(lambda self: self.h.tokens)
    @rule(data=st.data(), tail=tokens_st)
    def rollback(self, data, tail: list[int]) -> None:
        """Speculative decoding: all computed, roll back to an earlier length, append again."""
        seq_id = self._existing(data)
        tokens = self.h.tokens[seq_id]
        self.h.call("mark_computed", [seq_id], [len(tokens)])
        n = data.draw(st.integers(0, len(tokens)))
        self.h.call("truncate", seq_id, n)
        self.h.tokens[seq_id] = tokens[:n]
        self.append_tail(seq_id, tail)

    @rule(seq_id=st.integers(-3, -1))
    def unknown_ids(self, seq_id: int) -> None:
        for name, args in [("free", ()), ("append_tokens", ([1],)), ("truncate", (0,)), ("fork", (150,))]:
            assert self.h.call(name, seq_id, *args) == ("error", "unknown")

    @precondition(lambda self: self.h.tokens)
    @rule(data=st.data())
    def duplicate_ids(self, data) -> None:
        seq_id = self._existing(data)
        assert self.h.call("add_sequence", seq_id, [1]) == ("error", "duplicate")
        assert self.h.call("fork", seq_id, seq_id) == ("error", "duplicate")

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "h"):
            self.h.check()

    def teardown(self) -> None:
        if not hasattr(self, "h"):
            return
        for seq_id in list(self.h.tokens):
            self.h.call("free", seq_id)
        self.h.tokens.clear()
        self.h.check()
        stats = self.h.native.stats()
        assert stats["used_blocks"] == 0 and stats["num_sequences"] == 0
        assert stats["free_blocks"] + stats["cached_blocks"] == stats["total_blocks"]


BlockManagerMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerLockstep = BlockManagerMachine.TestCase
