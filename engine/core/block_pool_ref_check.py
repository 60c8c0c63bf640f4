"""Invariant check and statistics of the reference block manager (mirror the native ones)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from pagedinfer.engine.core.block_pool_ref_types import (
    ROOT_HASH,
    InvariantError,
    Registration,
    SequenceBlocks,
    chain_hash,
)


class BlockManager(Protocol):
    """The state of block_pool_ref.BlockManager these checks read (it calls them on itself)."""

    block_size: int
    num_total_blocks: int
    enable_prefix_caching: bool
    _refcount: list[int]
    _free: list[int]
    _lru: OrderedDict[int, None]
    _block_tokens: list[list[int]]
    _registrations: dict[int, Registration]
    _index: dict[int, int]
    _seqs: dict[int, SequenceBlocks]
    _counters: dict[str, int]

    def _is_child_of(self, block: int, parent: int) -> bool: ...


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise InvariantError(what)


def check_invariants(bm: BlockManager) -> None:
    """Raises InvariantError at the first inconsistency. O(everything)."""
    _check_blocks(bm)
    _check_sequences(bm)


def _check_blocks(bm: BlockManager) -> None:
    state = [""] * bm.num_total_blocks
    for block in bm._free:
        _require(0 <= block < len(state) and not state[block], f"free list: bad or repeated {block}")
        _require(bm._refcount[block] == 0 and block not in bm._registrations, f"free block {block} in use")
        state[block] = "free"
    for block in bm._lru:
        _require(not state[block], f"block {block} both free and evictable")
        _require(bm._refcount[block] == 0 and block in bm._registrations, f"evictable block {block} bad")
        state[block] = "evictable"
    for block, s in enumerate(state):
        _require(bool(s) or bm._refcount[block] > 0, f"block {block} is in no state (leaked)")
    _require(len(bm._index) == len(bm._registrations), "hash index size mismatch")
    for block, reg in bm._registrations.items():
        _require(bm._index.get(reg.hash) == block, f"block {block} not indexed")
        if not bm._is_child_of(block, reg.parent):
            continue
        parent_hash = bm._registrations[reg.parent].hash if reg.parent >= 0 else ROOT_HASH
        _require(chain_hash(parent_hash, bm._block_tokens[block]) == reg.hash, f"block {block} content")


def _check_sequences(bm: BlockManager) -> None:
    refs = [0] * bm.num_total_blocks
    bs = bm.block_size
    for seq_id, seq in bm._seqs.items():
        n = len(seq.tokens)
        _require(len(seq.blocks) == -(-n // bs), f"sequence {seq_id} block count")
        _require(0 <= seq.num_hashed_blocks <= n // bs, f"sequence {seq_id} num_hashed_blocks")
        for i, block in enumerate(seq.blocks):
            refs[block] += 1
            if i < seq.num_hashed_blocks and bm.enable_prefix_caching:
                _require(block in bm._registrations, f"sequence {seq_id} hashed block not cached")
            stored = bm._block_tokens[block][: min(bs, n - i * bs)]
            _require(
                stored == seq.tokens[i * bs : i * bs + len(stored)], f"sequence {seq_id} block {i} content"
            )
    for block, count in enumerate(refs):
        _require(
            count == bm._refcount[block], f"block {block} refcount {bm._refcount[block]} != {count} refs"
        )


def compute_stats(bm: BlockManager) -> dict[str, int | float]:
    total, free, cached = bm.num_total_blocks, len(bm._free), len(bm._lru)
    used = total - free - cached
    fill: dict[int, int] = {}  # a shared block stores as many tokens as its fullest user
    for seq in bm._seqs.values():
        for i, block in enumerate(seq.blocks):
            fill[block] = max(fill.get(block, 0), min(bm.block_size, len(seq.tokens) - i * bm.block_size))
    stored = sum(fill.values())
    c = bm._counters
    queries = c["prefix_cache_queries"]
    return {
        "total_blocks": total,
        "free_blocks": free,
        "used_blocks": used,
        "cached_blocks": cached,
        "available_blocks": free + cached,
        "occupancy": used / total,
        "stored_tokens": stored,
        "fragmentation_ratio": 1.0 - stored / (used * bm.block_size) if used else 0.0,
        "prefix_cache_hits": c["prefix_cache_hits"],
        "prefix_cache_queries": queries,
        "prefix_cache_hit_rate": c["prefix_cache_hits"] / queries if queries else 0.0,
        "cow_copies": c["cow_copies"],
        "evictions": c["evictions"],
        "num_sequences": len(bm._seqs),
    }
