"""The scheduler's view of the paged KV cache: the only Python module that imports `_native`.

Block ids stay opaque here; the scheduler asks for room in tokens and gets back either
success (plus copy-on-write block copies for the runner) or `False`, never an exception.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pagedinfer.engine.core.scheduler_output import BatchLayout


def _native_factory(num_blocks: int, block_size: int, enable_prefix_caching: bool) -> Any:
    from pagedinfer._native import BlockManager

    return BlockManager(num_blocks, block_size, enable_prefix_caching)


def _out_of_blocks_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = []
    try:
        from pagedinfer._native import OutOfBlocksError

        errors.append(OutOfBlocksError)
    except ImportError:
        pass
    try:
        from pagedinfer.engine.core.block_pool_ref import OutOfBlocksError as RefOutOfBlocksError

        errors.append(RefOutOfBlocksError)
    except ImportError:
        pass
    return tuple(errors) or (MemoryError,)


BackendFactory = Callable[[int, int, bool], Any]


class KVCacheManager:
    """Token-level allocation on top of a block manager (native, or the Python reference).

    `watermark_blocks` stay free at admission so running sequences can keep growing.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        watermark_blocks: int = 0,
        backend_factory: BackendFactory | None = None,
    ) -> None:
        factory = backend_factory or _native_factory
        self._blocks = factory(num_blocks, block_size, enable_prefix_caching)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.watermark_blocks = watermark_blocks
        self._oob_errors = _out_of_blocks_errors()
        self._num_prefix_queries = 0
        self._num_prefix_hits = 0

    # ---- capacity -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return int(self._blocks.num_free_blocks)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_to_admit(self, num_tokens: int) -> int:
        """Free blocks a sequence of `num_tokens` needs to be admitted (`allocate`'s test): its
        blocks, prefix-cache hits not subtracted, plus the watermark."""
        return self.blocks_for_tokens(num_tokens) + self.watermark_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / max(self.num_blocks, 1)

    # ---- per sequence ---------------------------------------------------------------------
    def allocate(self, seq_id: int, token_ids: Sequence[int], use_prefix_cache: bool = True) -> int | None:
        """Blocks for all `token_ids` (reusing prefix-cached ones); returns cached tokens.

        None when the pool minus the watermark cannot hold them. At least one token is left
        to compute so the step produces logits. `use_prefix_cache=False`: fresh blocks only, every
        token computed (prompt_logprobs need the logits of every prompt position).
        """
        # Conservative: prefix-cache hits are not subtracted, so admission never overcommits.
        if self.blocks_to_admit(len(token_ids)) > self.num_free_blocks:
            return None
        if not use_prefix_cache:
            self._blocks.add_sequence(seq_id, [])  # no tokens: no prefix match
            try:
                self._blocks.append_tokens(seq_id, list(token_ids))  # fresh blocks: no copies
            except self._oob_errors:
                self._blocks.free(seq_id)
                return None
            return 0
        try:
            num_cached = int(self._blocks.add_sequence(seq_id, list(token_ids)))
        except self._oob_errors:
            return None
        self._num_prefix_queries += len(token_ids)
        self._num_prefix_hits += num_cached
        return min(num_cached, len(token_ids) - 1)

    def append(self, seq_id: int, token_ids: Sequence[int]) -> list[tuple[int, int]] | None:
        """Slots for more tokens of a sequence; COW copies to run first, or None if no room."""
        if not token_ids:
            return []
        if self._blocks.blocks_needed_to_append(seq_id, len(token_ids)) > self.num_free_blocks:
            return None
        try:
            copies = self._blocks.append_tokens(seq_id, list(token_ids))
        except self._oob_errors:
            return None
        return [(int(s), int(d)) for s, d in copies]

    def append_batch(
        self, seq_ids: Sequence[int], token_ids: Sequence[int], num_tokens: Sequence[int]
    ) -> list[tuple[int, int]] | None:
        """`append` for many sequences in one call, all or nothing; None if they do not all fit."""
        try:
            copies = self._blocks.append_tokens_batch(
                np.asarray(seq_ids, dtype=np.int64),
                np.asarray(token_ids, dtype=np.int32),
                np.asarray(num_tokens, dtype=np.int32),
            )
        except self._oob_errors:
            return None
        return [(int(s), int(d)) for s, d in copies]

    def set_last_tokens(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> None:
        """Give placeholder tokens appended ahead of their sampling (async scheduling) their ids."""
        self._blocks.set_last_tokens(
            np.asarray(seq_ids, dtype=np.int64), np.asarray(token_ids, dtype=np.int32)
        )

    def set_tokens(self, seq_id: int, start: int, token_ids: Sequence[int]) -> None:
        """Overwrite a sequence's ids at [start, start + len(token_ids)) in place: placeholders of
        an asynchronous step learnt later. Blocks never move; raises if a touched block is shared
        or already prefix-cached."""
        self._blocks.set_tokens(seq_id, start, np.asarray(token_ids, dtype=np.int32))

    def blocks_needed_to_append(self, seq_id: int, num_tokens: int) -> int:
        return int(self._blocks.blocks_needed_to_append(seq_id, num_tokens))

    def blocks_needed_to_append_batch(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> int:
        """Exact blocks `append_batch` would take: new blocks and copy-on-write copies (of k
        appending holders of one shared last block, fewer than k may copy it)."""
        return int(
            self._blocks.blocks_needed_to_append_batch(
                np.asarray(seq_ids, dtype=np.int64), np.asarray(num_tokens, dtype=np.int32)
            )
        )

    def num_tokens(self, seq_id: int) -> int:
        return int(self._blocks.num_tokens(seq_id))

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        self._blocks.fork(parent_seq_id, child_seq_id)

    def truncate(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        return [(int(s), int(d)) for s, d in self._blocks.truncate(seq_id, num_tokens)]

    def free(self, seq_id: int) -> None:
        self._blocks.free(seq_id)

    def block_table(self, seq_id: int) -> list[int]:
        return [int(b) for b in self._blocks.block_table(seq_id)]

    # ---- per step -------------------------------------------------------------------------
    def mark_computed(self, seq_ids: Sequence[int], num_computed: Sequence[int]) -> None:
        if not seq_ids:
            return
        self._blocks.mark_computed(
            np.asarray(seq_ids, dtype=np.int64), np.asarray(num_computed, dtype=np.int32)
        )

    def build_batch(
        self, seq_ids: Sequence[int], num_computed: Sequence[int], num_new: Sequence[int]
    ) -> BatchLayout:
        batch = self._blocks.build_batch(
            np.asarray(seq_ids, dtype=np.int64),
            np.asarray(num_computed, dtype=np.int32),
            np.asarray(num_new, dtype=np.int32),
        )
        return BatchLayout(
            block_tables=np.asarray(batch.block_tables, dtype=np.int32),
            slot_mapping=np.asarray(batch.slot_mapping, dtype=np.int32),
            positions=np.asarray(batch.positions, dtype=np.int32),
            context_lens=np.asarray(batch.context_lens, dtype=np.int32),
            query_start_loc=np.asarray(batch.query_start_loc, dtype=np.int32),
        )

    def stats(self) -> dict[str, float]:
        stats = {k: float(v) for k, v in dict(self._blocks.stats()).items() if _is_number(v)}
        stats.setdefault("occupancy", self.usage)
        stats["kv_cache_usage"] = self.usage
        return stats


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
