"""Pure-Python reference of `pagedinfer._native.BlockManager`: same API, same policies.

Differential tests drive both with the same operations and expect identical block ids, copies
and statistics; the native benchmark compares against it. Simple on purpose: plain lists and
dicts, no NumPy beyond the returned arrays. Policies (mirrored exactly by the C++ core):

- Allocation pops the free list (lowest ids first), then evicts the least recently used cached
  block. A released block goes back to the free list, or to the LRU end if it is prefix-cached;
  a sequence releases its blocks last first, so a chain's tail is evicted before its head.
- A full block is cached (by `mark_computed`) under a chained hash of (parent hash, tokens). A
  lookup hits only if the tokens are equal and the parent is the very same registration of the
  previous block, so a hash collision never serves wrong content. A full computed block whose
  content is already cached elsewhere is swapped for the cached block (deduplication).
- Appending into a shared, partly filled last block copies it first (copy-on-write); appending
  into an exclusively held cached block drops it from the cache.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from pagedinfer.engine.core.block_pool_ref_check import check_invariants, compute_stats
from pagedinfer.engine.core.block_pool_ref_types import (
    INT32_RANGE,
    ROOT_HASH,
    BatchArrays,
    DuplicateSequenceError,
    InvariantError,
    OutOfBlocksError,
    Registration,
    SequenceBlocks,
    UnknownSequenceError,
    chain_hash,
    int_list,
)

__all__ = [  # the errors and BatchArrays belong to this module's API, as in pagedinfer._native
    "BatchArrays",
    "BlockManager",
    "DuplicateSequenceError",
    "InvariantError",
    "OutOfBlocksError",
    "UnknownSequenceError",
]


class BlockManager:
    """Paged KV-cache block manager (reference implementation). See `pagedinfer._native`."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if num_blocks * block_size > INT32_RANGE[1]:
            raise ValueError("num_blocks * block_size must fit in int32 (slot ids)")
        self.block_size = block_size
        self.num_total_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._refcount = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives block 0 first
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable, least recent first
        self._block_tokens = [[0] * block_size for _ in range(num_blocks)]
        self._registrations: dict[int, Registration] = {}  # block -> its cache registration
        self._index: dict[int, int] = {}  # hash -> block
        self._next_generation = 1
        self._seqs: dict[int, SequenceBlocks] = {}
        self._counters = dict(prefix_cache_hits=0, prefix_cache_queries=0, cow_copies=0, evictions=0)

    # ---- blocks ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._lru)

    def _require(self, needed: int, what: str) -> None:
        if needed > self.num_free_blocks:
            raise OutOfBlocksError(
                f"{what} needs {needed} blocks but only {self.num_free_blocks} are free or evictable"
            )

    def _allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._lru.popitem(last=False)
            self._unregister(block)
            self._counters["evictions"] += 1
        self._refcount[block] = 1
        return block

    def _incref(self, block: int) -> None:
        if self._refcount[block] == 0:
            del self._lru[block]
        self._refcount[block] += 1

    def _release(self, block: int) -> None:
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            if block in self._registrations:
                self._lru[block] = None
            else:
                self._free.append(block)

    def _register(self, block: int, block_hash: int, parent: int) -> None:
        parent_generation = self._registrations[parent].generation if parent >= 0 else 0
        self._registrations[block] = Registration(
            block_hash, parent, parent_generation, self._next_generation
        )
        self._next_generation += 1
        self._index[block_hash] = block

    def _unregister(self, block: int) -> None:
        del self._index[self._registrations.pop(block).hash]

    def _is_child_of(self, block: int, parent: int) -> bool:
        reg = self._registrations[block]
        if reg.parent != parent:
            return False
        return parent < 0 or (
            parent in self._registrations and self._registrations[parent].generation == reg.parent_generation
        )

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _write(self, seq: SequenceBlocks, start: int, tokens: list[int]) -> None:
        """Writes tokens at positions start.. of seq, allocating blocks at block boundaries."""
        bs = self.block_size
        for pos, token in enumerate(tokens, start):
            if pos % bs == 0:
                seq.blocks.append(self._allocate())
            self._block_tokens[seq.blocks[-1]][pos % bs] = token

    # ---- sequences ---------------------------------------------------------------------------
    def _get(self, seq_id: int) -> SequenceBlocks:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"unknown sequence {seq_id}") from None

    def _match_prefix(self, tokens: list[int]) -> list[int]:
        matched: list[int] = []
        if not self.enable_prefix_caching:
            return matched
        parent, parent_hash, bs = -1, ROOT_HASH, self.block_size
        for start in range(0, len(tokens) - bs + 1, bs):
            chunk = tokens[start : start + bs]
            block_hash = chain_hash(parent_hash, chunk)
            block = self._index.get(block_hash)
            if block is None or not self._is_child_of(block, parent):
                break
            if self._block_tokens[block] != chunk:
                break
            matched.append(block)
            parent, parent_hash = block, block_hash
        return matched

    def add_sequence(self, seq_id: int, token_ids: Sequence[int] | np.ndarray) -> int:
        if seq_id in self._seqs:
            raise DuplicateSequenceError(f"sequence {seq_id} already exists")
        tokens = int_list(token_ids, "token_ids")
        matched = self._match_prefix(tokens)
        reused_evictable = sum(1 for b in matched if self._refcount[b] == 0)
        self._require(self._blocks_for(len(tokens)) - len(matched) + reused_evictable, "add_sequence")
        seq = self._seqs[seq_id] = SequenceBlocks(tokens, list(matched), len(matched))
        for block in matched:
            self._incref(block)
        num_reused = len(matched) * self.block_size
        self._write(seq, num_reused, tokens[num_reused:])
        if self.enable_prefix_caching:
            self._counters["prefix_cache_queries"] += len(tokens)
            self._counters["prefix_cache_hits"] += num_reused
        return num_reused

    def _append_need(self, seq: SequenceBlocks, num_tokens: int) -> int:
        length = len(seq.tokens)
        new_blocks = self._blocks_for(length + num_tokens) - self._blocks_for(length)
        cow = num_tokens > 0 and length % self.block_size != 0 and self._refcount[seq.blocks[-1]] > 1
        return new_blocks + int(cow)

    def blocks_needed_to_append(self, seq_id: int, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError("num_tokens must be >= 0")
        return self._append_need(self._get(seq_id), num_tokens)

    def _batch_append_need(self, seqs: list[SequenceBlocks], counts: list[int]) -> int:
        # Of k writers into a shared last block with refcount r, the first min(k, r - 1) copy.
        writers: dict[int, int] = {}
        needed = 0
        for seq, n in zip(seqs, counts, strict=True):
            length = len(seq.tokens)
            needed += self._blocks_for(length + n) - self._blocks_for(length)
            if n > 0 and length % self.block_size != 0 and self._refcount[seq.blocks[-1]] > 1:
                writers[seq.blocks[-1]] = writers.get(seq.blocks[-1], 0) + 1
        return needed + sum(min(k, self._refcount[b] - 1) for b, k in writers.items())

    def blocks_needed_to_append_batch(
        self, seq_ids: Sequence[int] | np.ndarray, num_tokens: Sequence[int] | np.ndarray
    ) -> int:
        """Exact blocks `append_tokens_batch` would take for these counts (ids distinct)."""
        seqs, counts = self._batch_args(seq_ids, num_tokens)
        return self._batch_append_need(seqs, counts)

    def _batch_args(
        self, seq_ids: Sequence[int] | np.ndarray, num_tokens: Sequence[int] | np.ndarray
    ) -> tuple[list[SequenceBlocks], list[int]]:
        """The sequences and counts of a batch append, checked as the native core checks them."""
        ids = int_list(seq_ids, "seq_ids")
        counts = int_list(num_tokens, "num_tokens")
        if len(ids) != len(counts):
            raise ValueError("seq_ids and num_tokens differ in length")
        seqs = self._distinct_sequences(ids)
        if any(n < 0 for n in counts):
            raise ValueError("num_tokens must be >= 0")
        return seqs, counts

    def _distinct_sequences(self, ids: list[int]) -> list[SequenceBlocks]:
        """A batch's sequences in order, as the native core finds them: the first repeated or
        unknown id, whichever comes first, raises."""
        seqs: list[SequenceBlocks] = []
        seen: set[int] = set()
        for seq_id in ids:
            if seq_id in seen:
                raise ValueError("a sequence id appears twice in one batch")
            seen.add(seq_id)
            seqs.append(self._get(seq_id))
        return seqs

    def append_tokens(self, seq_id: int, token_ids: Sequence[int] | np.ndarray) -> list[tuple[int, int]]:
        seq = self._get(seq_id)
        tokens = int_list(token_ids, "token_ids")
        if not tokens:
            return []
        self._require(self._append_need(seq, len(tokens)), "append_tokens")
        return self._append(seq, tokens)

    def _append(self, seq: SequenceBlocks, tokens: list[int]) -> list[tuple[int, int]]:
        copies: list[tuple[int, int]] = []
        if len(seq.tokens) % self.block_size != 0:
            last = seq.blocks[-1]
            if self._refcount[last] > 1:
                copy = self._allocate()
                self._block_tokens[copy] = list(self._block_tokens[last])
                self._release(last)
                seq.blocks[-1] = copy
                copies.append((last, copy))
                self._counters["cow_copies"] += 1
            elif last in self._registrations:
                self._unregister(last)  # its content is about to change
        self._write(seq, len(seq.tokens), tokens)
        seq.tokens.extend(tokens)
        return copies

    def append_tokens_batch(
        self,
        seq_ids: Sequence[int] | np.ndarray,
        token_ids: Sequence[int] | np.ndarray,
        num_tokens: Sequence[int] | np.ndarray,
    ) -> list[tuple[int, int]]:
        """append_tokens for many sequences in one call (all or nothing); returns all copies."""
        seqs, counts = self._batch_args(seq_ids, num_tokens)
        tokens = int_list(token_ids, "token_ids")
        if sum(counts) != len(tokens):
            raise ValueError("token_ids length differs from the sum of num_tokens")
        needed = self._batch_append_need(seqs, counts)
        self._require(needed, "append_tokens_batch")
        copies: list[tuple[int, int]] = []
        start = 0
        for seq, n in zip(seqs, counts, strict=True):
            if n > 0:
                copies += self._append(seq, tokens[start : start + n])
            start += n
        return copies

    def set_last_tokens(
        self, seq_ids: Sequence[int] | np.ndarray, token_ids: Sequence[int] | np.ndarray
    ) -> None:
        """Replace each sequence's last token (a placeholder appended before its id was known).

        Its block must be exclusively owned and not yet prefix-cached; all or nothing."""
        ids = int_list(seq_ids, "seq_ids")
        tokens = int_list(token_ids, "token_ids")
        if len(ids) != len(tokens):
            raise ValueError("seq_ids and token_ids differ in length")
        seqs = self._distinct_sequences(ids)
        bs = self.block_size
        for seq_id, seq in zip(ids, seqs, strict=True):
            last = len(seq.tokens) - 1
            if last < 0:
                raise ValueError(f"sequence {seq_id} has no token to replace")
            if last // bs < seq.num_hashed_blocks:
                raise ValueError(f"sequence {seq_id}: its last token's block is already prefix-cached")
            if self._refcount[seq.blocks[last // bs]] != 1:
                raise ValueError(f"sequence {seq_id}: its last token's block is shared")
        for seq, token in zip(seqs, tokens, strict=True):
            last = len(seq.tokens) - 1
            block = seq.blocks[last // bs]
            if block in self._registrations:  # a truncated block: its content changes
                self._unregister(block)
            seq.tokens[last] = token
            self._block_tokens[block][last % bs] = token

    def set_tokens(self, seq_id: int, start: int, token_ids: Sequence[int] | np.ndarray) -> None:
        """Overwrite the recorded ids at positions [start, start + len(token_ids)) in place.

        For placeholders of an asynchronous step whose real ids arrived later: never allocates or
        moves a block. Every touched block must be exclusively owned and not yet prefix-cached."""
        seq = self._get(seq_id)
        start = operator.index(start)
        tokens = int_list(token_ids, "token_ids")
        if not tokens:
            return
        end = start + len(tokens)
        if start < 0 or end > len(seq.tokens):
            raise ValueError(
                f"sequence {seq_id}: {len(tokens)} tokens from position {start} "
                f"do not fit in its {len(seq.tokens)} tokens"
            )
        bs = self.block_size
        touched = range(start // bs, (end - 1) // bs + 1)
        if touched[0] < seq.num_hashed_blocks:  # hashed blocks are leading
            raise ValueError(
                f"sequence {seq_id}: position {start} is in a block that is already prefix-cached"
            )
        for i in touched:
            if self._refcount[seq.blocks[i]] != 1:
                raise ValueError(f"sequence {seq_id}: its block {i} is shared")
        for i in touched:
            if seq.blocks[i] in self._registrations:  # only after a truncate: its content changes
                self._unregister(seq.blocks[i])
        seq.tokens[start:end] = tokens
        for pos, token in enumerate(tokens, start):
            self._block_tokens[seq.blocks[pos // bs]][pos % bs] = token

    def fork(self, parent_id: int, child_id: int) -> None:
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise DuplicateSequenceError(f"sequence {child_id} already exists")
        self._seqs[child_id] = SequenceBlocks(
            list(parent.tokens), list(parent.blocks), parent.num_hashed_blocks
        )
        for block in parent.blocks:
            self._incref(block)

    def truncate(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        seq = self._get(seq_id)
        if not 0 <= num_tokens <= len(seq.tokens):
            raise ValueError(f"cannot truncate sequence {seq_id} of {len(seq.tokens)} tokens to {num_tokens}")
        keep = self._blocks_for(num_tokens)
        for block in reversed(seq.blocks[keep:]):
            self._release(block)
        del seq.blocks[keep:]
        del seq.tokens[num_tokens:]
        seq.num_hashed_blocks = min(seq.num_hashed_blocks, num_tokens // self.block_size)
        return []

    def free(self, seq_id: int) -> None:
        seq = self._get(seq_id)
        for block in reversed(seq.blocks):
            self._release(block)
        del self._seqs[seq_id]

    # ---- per step ----------------------------------------------------------------------------
    def mark_computed(
        self, seq_ids: Sequence[int] | np.ndarray, num_computed_tokens: Sequence[int] | np.ndarray
    ) -> None:
        ids = int_list(seq_ids, "seq_ids")
        nums = int_list(num_computed_tokens, "num_computed_tokens")
        if len(ids) != len(nums):
            raise ValueError("seq_ids and counts differ in length")
        seqs = [self._get(i) for i in ids]
        for seq_id, seq, num in zip(ids, seqs, nums, strict=True):
            if not 0 <= num <= len(seq.tokens):
                raise ValueError(f"num_computed_tokens {num} out of range for sequence {seq_id}")
        if self.enable_prefix_caching:
            for seq, num in zip(seqs, nums, strict=True):
                self._cache_full_blocks(seq, num)

    def _cache_full_blocks(self, seq: SequenceBlocks, num_computed: int) -> None:
        bs = self.block_size
        for i in range(seq.num_hashed_blocks, num_computed // bs):
            block = seq.blocks[i]
            parent = seq.blocks[i - 1] if i > 0 else -1
            if block not in self._registrations:
                chunk = seq.tokens[i * bs : (i + 1) * bs]
                parent_hash = self._registrations[parent].hash if parent >= 0 else ROOT_HASH
                block_hash = chain_hash(parent_hash, chunk)
                cached = self._index.get(block_hash)
                if cached is None:
                    self._register(block, block_hash, parent)
                elif self._is_child_of(cached, parent) and self._block_tokens[cached] == chunk:
                    self._incref(cached)  # deduplicate: converge on the cached block
                    seq.blocks[i] = cached
                    self._release(block)
                elif not self._is_child_of(cached, self._registrations[cached].parent) and (
                    self._refcount[cached] == 0
                ):
                    self._unregister(cached)  # unreachable leftover: replace it
                    del self._lru[cached]
                    self._free.append(cached)
                    self._register(block, block_hash, parent)
                else:
                    return  # hash collision: stop caching this sequence here
            seq.num_hashed_blocks = i + 1

    def build_batch(
        self,
        seq_ids: Sequence[int] | np.ndarray,
        num_computed_tokens: Sequence[int] | np.ndarray,
        num_new_tokens: Sequence[int] | np.ndarray,
        max_blocks: int | None = None,
    ) -> BatchArrays:
        ids = int_list(seq_ids, "seq_ids")
        computed = int_list(num_computed_tokens, "num_computed_tokens")
        new = int_list(num_new_tokens, "num_new_tokens")
        if not len(ids) == len(computed) == len(new):
            raise ValueError("seq_ids, num_computed_tokens and num_new_tokens differ in length")
        seqs = [self._get(i) for i in ids]
        for seq_id, seq, c, n in zip(ids, seqs, computed, new, strict=True):
            if c < 0 or n < 0 or c + n > len(seq.tokens):
                raise ValueError(f"sequence {seq_id}: computed {c} + new {n} tokens out of range")
        width = max((self._blocks_for(c + n) for c, n in zip(computed, new, strict=True)), default=0)
        if max_blocks is not None and (max_blocks < 0 or max_blocks < width):
            raise ValueError(f"max_blocks {max_blocks} < {width} blocks needed by the batch")
        width = width if max_blocks is None else max_blocks
        tables = np.zeros((len(ids), width), dtype=np.int32)
        slots: list[int] = []
        positions: list[int] = []
        bs = self.block_size
        for row, (seq, c, n) in enumerate(zip(seqs, computed, new, strict=True)):
            used = self._blocks_for(c + n)
            tables[row, :used] = seq.blocks[:used]
            positions.extend(range(c, c + n))
            slots.extend(seq.blocks[p // bs] * bs + p % bs for p in range(c, c + n))
        context = [c + n for c, n in zip(computed, new, strict=True)]
        return BatchArrays(
            block_tables=tables,
            slot_mapping=np.array(slots, dtype=np.int32),
            positions=np.array(positions, dtype=np.int32),
            context_lens=np.array(context, dtype=np.int32),
            query_start_loc=np.array([0, *np.cumsum(new, dtype=np.int64).tolist()], dtype=np.int32),
        )

    # ---- queries -----------------------------------------------------------------------------
    def can_allocate(self, num_tokens: int) -> bool:
        return num_tokens >= 0 and self._blocks_for(num_tokens) <= self.num_free_blocks

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def num_tokens(self, seq_id: int) -> int:
        return len(self._get(seq_id).tokens)

    def token_ids(self, seq_id: int) -> np.ndarray:
        return np.array(self._get(seq_id).tokens, dtype=np.int32)

    def block_table(self, seq_id: int) -> np.ndarray:
        return np.array(self._get(seq_id).blocks, dtype=np.int32)

    def _check_block(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_total_blocks:
            raise IndexError(f"block id {block_id} out of range")

    def block_refcount(self, block_id: int) -> int:
        self._check_block(block_id)
        return self._refcount[block_id]

    def block_tokens(self, block_id: int) -> np.ndarray:
        self._check_block(block_id)
        return np.array(self._block_tokens[block_id], dtype=np.int32)

    def stats(self) -> dict[str, int | float]:
        return compute_stats(self)

    def check_invariants(self) -> None:
        check_invariants(self)
