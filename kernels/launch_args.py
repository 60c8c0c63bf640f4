"""Launch arguments the paged-attention kernels (decode, extend, short extend) share."""

from __future__ import annotations

import torch


def paged_attention_strides(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    out: torch.Tensor,
) -> tuple[int, ...]:
    """The 11 element strides the kernels take in this order: query (token, head), key cache
    (block, slot, KV head), value cache (block, slot, KV head), block table (row), out (token,
    head). Head dims are contiguous, so their stride is not passed."""
    return (
        query.stride(0),
        query.stride(1),
        *key_cache.stride()[:3],
        *value_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
    )
