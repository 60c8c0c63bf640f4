"""Argument checks shared by the launchers: shapes, dtypes and devices raise ValueError.

Value checks (slot ranges, lengths against the block table) need the data on the host; they run
only for CPU tensors, so a CUDA launch never synchronizes to validate.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256


def _fail(msg: str) -> None:
    raise ValueError(msg)


def _check_shape(name: str, t: torch.Tensor, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        _fail(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")


def _check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        _fail(f"tensors must share one device, got {devices}")


def _check_index(name: str, t: torch.Tensor, ndim: int, dtypes=INDEX_DTYPES) -> None:
    _check_shape(name, t, ndim)
    if t.dtype not in dtypes:
        _fail(f"{name} must have dtype in {dtypes}, got {t.dtype}")


def check_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """key_cache/value_cache: [num_blocks, block_size, num_kv_heads, head_dim], same dtype/device."""
    _check_shape("key_cache", key_cache, 4)
    _check_shape("value_cache", value_cache, 4)
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        _fail(
            f"key_cache {tuple(key_cache.shape)} {key_cache.dtype} and value_cache "
            f"{tuple(value_cache.shape)} {value_cache.dtype} must match in shape and dtype"
        )
    if key_cache.dtype not in FLOAT_DTYPES:
        _fail(f"cache dtype must be one of {FLOAT_DTYPES}, got {key_cache.dtype}")
    if key_cache.shape[3] > MAX_HEAD_DIM:
        _fail(f"head_dim must be <= {MAX_HEAD_DIM}, got {key_cache.shape[3]}")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        _fail("caches must be contiguous in head_dim")


def check_write(key, value, key_cache, value_cache, slot_mapping) -> None:
    check_caches(key_cache, value_cache)
    _check_shape("key", key, 3)
    _check_shape("value", value, 3)
    _check_index("slot_mapping", slot_mapping, 1)
    _check_same_device(key=key, value=value, key_cache=key_cache, slot_mapping=slot_mapping)
    expect = (slot_mapping.shape[0], key_cache.shape[2], key_cache.shape[3])
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape) != expect:
            _fail(f"{name} must be [num_tokens, num_kv_heads, head_dim] = {expect}, got {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            _fail(f"{name} dtype must be one of {FLOAT_DTYPES}, got {t.dtype}")
    if slot_mapping.device.type == "cpu" and slot_mapping.numel():
        capacity = key_cache.shape[0] * key_cache.shape[1]
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < 0 or hi >= capacity:
            _fail(f"slot_mapping values must lie in [0, {capacity}), got [{lo}, {hi}]")


def _check_attention_common(query, key_cache, value_cache, block_tables, scale) -> None:
    check_caches(key_cache, value_cache)
    _check_shape("query", query, 3)
    _check_index("block_tables", block_tables, 2, (torch.int32,))
    _check_same_device(query=query, key_cache=key_cache, block_tables=block_tables)
    if query.dtype != key_cache.dtype:
        _fail(f"query dtype {query.dtype} must equal the cache dtype {key_cache.dtype}")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if head_dim != key_cache.shape[3]:
        _fail(f"query head_dim {head_dim} != cache head_dim {key_cache.shape[3]}")
    if num_heads % num_kv_heads:
        _fail(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if query.stride(-1) != 1:
        _fail("query must be contiguous in head_dim")
    if not isinstance(scale, (int, float)) or not scale > 0:
        _fail(f"scale must be a positive float, got {scale!r}")


def _check_block_ids(block_tables: torch.Tensor, lens: torch.Tensor, block_size: int, num_blocks: int):
    """On CPU: lens fit the table, and the ids a sequence uses are valid blocks."""
    capacity = block_tables.shape[1] * block_size
    if lens.numel() and (int(lens.min()) < 0 or int(lens.max()) > capacity):
        _fail(f"lengths must lie in [0, {capacity}] (max_blocks_per_seq * block_size)")
    used_blocks = (lens.long() + block_size - 1) // block_size  # [S]
    cols = torch.arange(block_tables.shape[1])
    used = block_tables[cols[None, :] < used_blocks[:, None]]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
        _fail(f"block_tables entries in use must lie in [0, {num_blocks})")


def check_decode(
    query, key_cache, value_cache, block_tables, context_lens, scale, max_context_len=None
) -> None:
    _check_attention_common(query, key_cache, value_cache, block_tables, scale)
    if max_context_len is not None and (
        isinstance(max_context_len, bool) or not isinstance(max_context_len, int) or max_context_len < 1
    ):
        _fail(f"max_context_len must be a positive int or None, got {max_context_len!r}")
    _check_index("context_lens", context_lens, 1, (torch.int32,))
    _check_same_device(query=query, context_lens=context_lens)
    num_seqs = query.shape[0]
    if block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs:
        _fail(
            f"block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} "
            f"must have num_seqs={num_seqs} rows"
        )
    if context_lens.device.type == "cpu":
        _check_block_ids(block_tables, context_lens, key_cache.shape[1], key_cache.shape[0])
        longest = int(context_lens.max()) if num_seqs else 0
        if max_context_len is not None and longest > max_context_len:
            _fail(f"max_context_len={max_context_len} is below the longest context length {longest}")


def check_extend(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale) -> None:
    _check_attention_common(query, key_cache, value_cache, block_tables, scale)
    _check_index("query_start_loc", query_start_loc, 1, (torch.int32,))
    _check_index("seq_lens", seq_lens, 1, (torch.int32,))
    _check_same_device(query=query, query_start_loc=query_start_loc, seq_lens=seq_lens)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        _fail(
            f"query_start_loc must be [num_seqs + 1] and block_tables [num_seqs, *] with num_seqs="
            f"{num_seqs}; got {tuple(query_start_loc.shape)} and {tuple(block_tables.shape)}"
        )
    if seq_lens.device.type != "cpu":
        return
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    if int(query_start_loc[0]) != 0 or int(query_start_loc[-1]) != query.shape[0]:
        _fail(f"query_start_loc must run from 0 to num_tokens={query.shape[0]}")
    if q_lens.numel() and int(q_lens.min()) < 0:
        _fail("query_start_loc must be non-decreasing")
    if bool((seq_lens < q_lens).any()):
        _fail("seq_lens must count cached + new tokens (seq_lens[s] >= q_len of s)")
    _check_block_ids(block_tables, seq_lens, key_cache.shape[1], key_cache.shape[0])


def check_copy_blocks(key_caches, value_caches, block_copies) -> None:
    if len(key_caches) != len(value_caches):
        _fail(f"{len(key_caches)} key caches but {len(value_caches)} value caches")
    for k, v in zip(key_caches, value_caches, strict=True):
        check_caches(k, v)
    _check_index("block_copies", block_copies, 2, (torch.int64,))
    if block_copies.shape[1] != 2:
        _fail(f"block_copies must be [n, 2] (src, dst), got {tuple(block_copies.shape)}")
    if block_copies.device.type == "cpu" and block_copies.numel() and key_caches:
        num_blocks = key_caches[0].shape[0]
        if int(block_copies.min()) < 0 or int(block_copies.max()) >= num_blocks:
            _fail(f"block_copies ids must lie in [0, {num_blocks})")
