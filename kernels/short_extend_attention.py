"""Triton paged extend attention for short query chunks: GQA-packed and split-K, like decode.

Speculative verification scores K drafted tokens + 1 per sequence (2-16 tokens). The tiled extend
kernel (extend_attention.py) gives every (query tile, query head) a program of >= 64 rows, so a
5-token verification is one mostly-padding program per query head: each KV head is read once per
query head of its group, and the whole context streams through one serial loop per program.

Here a program takes the new tokens of one sequence (all of them, or a block of them: see
tokens_per_program) times the GROUP query heads of one KV head
(row r = token * GROUP + head in group, or token * GROUP_P2 + head: `packs_rows`; a K/V tile is
loaded once for all of them) and one split of the context, as the decode kernel does; row r sees
the keys up to its own position
(seq_len - q_len + token). With several splits each writes a normalized partial and its base-2
log-sum-exp per (token, head) row, merged as the decode kernel's are (decode_attention.
default_merge for the same grid, up to FUSED_MAX_SPLITS splits): by a second kernel, launched as a
programmatic dependent on small grids (batch 1), or in the kernel by the split that arrives last.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedinfer.kernels.decode_attention import (
    LOG2E,
    MAX_SPLITS,
    choose_merge,
    default_num_splits,
    fused_counters,
    load_kv_tile,
    tile_block_ids,
)
from pagedinfer.kernels.decode_merge import (
    SplitMerge,
    fused_split_chunk,
    gdc_launch_dependents,
    merge_rows,
    reduce_splits,
)
from pagedinfer.kernels.launch_args import paged_attention_strides

# Rows of one program (query tokens x group heads, packed, padded to a power of two) up to which the short
# path is taken: 16 tokens at group 4 (Llama-3-8B), 8 at group 8. What bounds it is the program's
# size (its fp32 accumulator is ROWS x D_PAD: 64 registers a thread at 64 x 128 and 4 warps), not
# the tiled kernel's padding, which is still most of its 64-128-row tiles at 17 tokens. Measured
# up to 64 rows at head_dim 128 (bench/NOTES.md v8).
MAX_ROWS = 64
# Tokens a sequence up to which the dispatch picks this kernel: verification's K + 1; with small
# GQA groups (MHA: group 1) prefill chunks of up to 64 tokens would fit the rows too, and those
# are the tiled kernel's to take (not measured here).
MAX_TOKENS = 16
# The merge in the kernel (decode's rule from 16 programs) up to this many splits; above, the
# separate merge kernel. The last split's program merges all its rows (tokens x group) over every
# split alone: H100, bench/verify_attention.py 2026-12-05 16:07 UTC, per call: Llama-3-8B batch 8
# x 5 tokens (5 splits) 22.2 vs 25.2 us at 512 tokens of context, 51.5 vs 53.7 at 2048; SmolLM2
# batch 8 x 5 (22 splits) 15.2 vs 11.3 us. PAGEDINFER_SHORT_EXTEND_FUSED_MAX_SPLITS moves it (A/B).
FUSED_MAX_SPLITS = int(os.environ.get("PAGEDINFER_SHORT_EXTEND_FUSED_MAX_SPLITS", "8"))
# Rows a program takes at most when a sequence's tokens are split over several programs (token
# blocks): 0 keeps every token of a sequence in one program. PAGEDINFER_SHORT_EXTEND_BLOCK_ROWS
# moves it (A/B).
BLOCK_ROWS = int(os.environ.get("PAGEDINFER_SHORT_EXTEND_BLOCK_ROWS", "16"))
# Split-K from the grid: decode's rule (default_num_splits), except that a grid of at least
# WIDE_GRID programs (token blocks counted) takes at most WIDE_GRID_SPLITS splits (the fused merge's
# most; the merge itself follows the sequences' grid, `merge_for`: in the kernel from 16). Decode's
# rule aims at 4 waves under 64 programs (its programs take one token each): SmolLM2 at batch 8,
# K 4 / 6 (48 programs) got 11 splits and the separate merge kernel, where at most 8 made a
# verifying pass 3-5% cheaper (H100 engine A/B of caps 2-8, bench/NOTES.md session 33). 8 rather
# than the 4-6 that measured alike there: splits hold whole 64-key tiles, so 8 splits leave as many
# of them working, each as many tiles, as 11 do up to 512 keys and from 705 to 1,024 (at 513-704
# and past 1,024 some 8-split programs take one tile more); 6 splits measured 0.8-2.4 us slower a
# call in isolation at 420 and 1,024 keys (bench/verify_attention.py). SmolLM2 at batch 1 (3-6
# programs) keeps decode's rule: a cap of 4 cost it ~1%. Not measured: the other grids of 32-63
# programs (SmolLM2 at batch 6-7 and K 4-7, batch 11-21 and K <= 3; Llama-3-8B at batch 1 and
# K >= 12, batch 2-3 and K >= 4; longer K at smaller batches).
# PAGEDINFER_SHORT_EXTEND_WIDE_GRID_SPLITS=0 restores decode's rule everywhere (A/B).
WIDE_GRID = 32
WIDE_GRID_SPLITS = int(os.environ.get("PAGEDINFER_SHORT_EXTEND_WIDE_GRID_SPLITS", "8"))
# At most this many splits where the grid picks them (0: no cap); an A/B switch,
# PAGEDINFER_SHORT_EXTEND_MAX_SPLITS.
SPLIT_CAP = int(os.environ.get("PAGEDINFER_SHORT_EXTEND_MAX_SPLITS", "0"))
# A/B switch for benchmarks: PAGEDINFER_SHORT_EXTEND=0 sends short chunks to the tiled kernel.
SHORT_EXTEND_ENABLED = os.environ.get("PAGEDINFER_SHORT_EXTEND", "1") != "0"


@dataclass(frozen=True)
class ShortExtendConfig:
    """Tile shape (BLOCK_N keys per iteration) of the short-chunk kernel."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3


def default_config(device: torch.device) -> ShortExtendConfig:
    if device.type != "cuda":  # interpreter: each iteration costs, not the tile's size
        return ShortExtendConfig(block_n=32, num_warps=4, num_stages=1)
    return ShortExtendConfig()


def rows_per_program(max_query_len: int, group: int) -> int:
    """A program's rows: tokens x group, padded to a power of two of at least 16 (tl.dot's
    minimum). Never more than padding tokens and group each (the other layout, `packs_rows`)."""
    return max(16, triton.next_power_of_2(max(1, max_query_len) * group))


def padded_rows(max_query_len: int, group: int) -> int:
    """A program's rows laid out as token * group_p2 + head: tokens and group each padded to a
    power of two (at least 16 in all)."""
    return max(16, triton.next_power_of_2(max(1, max_query_len)) * triton.next_power_of_2(group))


def packs_rows(max_query_len: int, group: int) -> bool:
    """Whether rows are packed as token * group + head (SmolLM2's 5 tokens x group 3: 16 rows) or
    laid out as token * group_p2 + head (padding each: 32 there). Packed only where it takes fewer
    rows: at equal rows the padded layout measured faster in the engine (H100, n-gram batch 8, K 2:
    verifying pass 1.04 vs 1.065 of a plain one, bench/NOTES.md session 27)."""
    return rows_per_program(max_query_len, group) < padded_rows(max_query_len, group)


def tokens_per_program(max_query_len: int, group: int, block_rows: int | None = None) -> int:
    """Tokens of a sequence one program takes: all of them, or with `block_rows` (default
    BLOCK_ROWS; 0: off; meant as a power of two >= 16, tl.dot's least rows) as few equal blocks as
    keep each within that many rows of the padded layout (`padded_rows`): SmolLM2's 7 tokens x
    group 3 as 4 + 3 tokens, its 5 as 3 + 2, 16 rows each. Sized by the padded layout, blocks of
    <= 16 rows never pack (wider ones may, where packing takes fewer rows: 5 tokens x 3 at 32).
    What blocks buy at batch 8 is the grid they make (48 programs: fewer splits, `grid_splits`),
    not their rows: at K 4, one packed 15-row program (16 splits) and 3 + 2 tokens (11), both with
    the separate merge, cost within 1.5% of each other; 3 + 2 and 2 + 2 + 1 tokens at 4 splits the
    same within the runs' spread (H100 engine A/B, bench/NOTES.md session 33). Each block reads the
    sequence's K/V again (from L2 at these sizes)."""
    block_rows = BLOCK_ROWS if block_rows is None else block_rows
    tokens = max(1, max_query_len)
    fit = block_rows // triton.next_power_of_2(group)
    if block_rows <= 0 or fit < 1 or padded_rows(tokens, group) <= block_rows:
        return tokens
    return triton.cdiv(tokens, triton.cdiv(tokens, fit))


def takes(max_query_len: int | None, num_heads: int, num_kv_heads: int) -> bool:
    """Whether a chunk of at most max_query_len tokens a sequence goes to this kernel."""
    if not SHORT_EXTEND_ENABLED or max_query_len is None or max_query_len < 1:
        return False
    if max_query_len > MAX_TOKENS:
        return False
    return rows_per_program(max_query_len, num_heads // num_kv_heads) <= MAX_ROWS


@triton.jit
def _short_extend_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [NB, BS, KVH, D]
    v_cache_ptr,  # [NB, BS, KVH, D]
    block_tables_ptr,  # int32 [S, MB]
    query_start_loc_ptr,  # int32 [S + 1]
    seq_lens_ptr,  # int32 [S]: cached + new tokens
    out_ptr,  # [T, H, D] (written when not IS_SPLIT)
    part_out_ptr,  # fp32 [T, H, num_splits, D_PAD] (written when IS_SPLIT)
    part_lse_ptr,  # fp32 [T, H, num_splits]
    counter_ptr,  # int32 [>= S * token_blocks * KVH], zero on entry and on exit (MERGE_FUSED only)
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bts, stride_ot, stride_oh, head_dim, num_heads, num_splits,
    IS_SPLIT: tl.constexpr, MERGE_FUSED: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
    TOKEN_BLOCKS: tl.constexpr,  # programs a sequence's tokens are spread over (axis 0: seq * it + block)
    TOKENS: tl.constexpr,  # tokens a program takes (a block's; the last one's may be fewer)
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, PACKED: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
):  # fmt: skip
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()  # the PDL merge may be scheduled now; it waits for our results
    # One block: the kernel as it was before token blocks, op for op (identical PTX). A form that
    # emitted the block masks with one block too (the same work plus a compare a row) ran a batch-8
    # K 2 verifying pass at 1.07 of a plain one vs 1.04 (H100 A/B, bench/NOTES.md session 31).
    block_row = tl.program_id(0)  # (seq, block): its fused-merge counter
    if TOKEN_BLOCKS > 1:
        seq = block_row // TOKEN_BLOCKS
    else:
        seq = block_row
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    r = tl.arange(0, ROWS)
    if PACKED:  # token * GROUP + head (packs_rows)
        tok = r // GROUP
        g = r % GROUP
    else:  # token * GROUP_P2 + head
        tok = r // GROUP_P2
        g = r % GROUP_P2
    if TOKEN_BLOCKS > 1:  # the block's tokens; rows past TOKENS pad the block
        in_block = tok < TOKENS
        tok = (block_row % TOKEN_BLOCKS) * TOKENS + tok
    row_ok = tok < q_len
    if not PACKED:
        row_ok = row_ok & (g < GROUP)
    if TOKEN_BLOCKS > 1:
        row_ok = row_ok & in_block
    heads = kv_head * GROUP + g  # [ROWS]
    last_key = tl.where(row_ok, seq_len - q_len + tok, -1)  # causal: the row's own position
    tokens = (q_start + tok).to(tl.int64)
    d = tl.arange(0, D_PAD)
    d_mask = d < head_dim
    q_ptrs = q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_mask[None, :], other=0.0)  # [ROWS, D_PAD]

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        n_mask = pos < end
        ids = tile_block_ids(table_row, pos, end, BLOCK_SIZE)
        k = load_kv_tile(k_base, ids, pos, n_mask, d, d_mask, stride_kb, stride_ks, BLOCK_SIZE)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * qk_scale  # [ROWS, BLOCK_N]
        s = tl.where(n_mask[None, :] & (pos[None, :] <= last_key[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row may see no key of this tile yet
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_kv_tile(v_base, ids, pos, n_mask, d, d_mask, stride_vb, stride_vs, BLOCK_SIZE)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new

    has_keys = l_i > 0.0
    out = tl.where(has_keys[:, None], acc / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
    if not IS_SPLIT:
        o_ptrs = out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])
    else:
        row = (tokens * num_heads + heads) * num_splits + split  # [ROWS]
        tl.store(part_out_ptr + row[:, None] * D_PAD + d[None, :], out, mask=row_ok[:, None])
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=row_ok)
        if MERGE_FUSED:  # as the decode kernel's: the last split of (seq, block, KV head) merges its rows
            tl.debug_barrier()  # every thread's partial stores precede the release below
            counter = counter_ptr + block_row * tl.num_programs(1) + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                o_rows = out_ptr + tokens * stride_ot + heads * stride_oh
                merge_rows(
                    part_out_ptr, part_lse_ptr, tokens * num_heads + heads, row_ok, o_rows, head_dim,
                    num_splits, SPLITS_PAD, SPLIT_CHUNK, D_PAD,
                )  # fmt: skip
                tl.store(counter, 0)  # zero again for the next call (and the next graph replay)


def paged_short_extend_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    num_splits: int | None = None,
    config: ShortExtendConfig | None = None,
    merge: SplitMerge | None = None,
    block_rows: int | None = None,
) -> torch.Tensor:
    """query [T, H, D] -> out [T, H, D], every sequence bringing <= max_query_len new tokens
    (ops.paged_extend_attention checks it for CPU tensors only: on CUDA the rows past it are never
    computed). num_splits None: from the grid (`grid_splits`); merge None: decode's rule for the
    sequences' grid (decode_attention.default_merge), the separate merge above FUSED_MAX_SPLITS splits.
    block_rows: see tokens_per_program (None: BLOCK_ROWS)."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    if rows_per_program(max_query_len, group) > MAX_ROWS:
        raise ValueError(f"{max_query_len} tokens x group {group} exceed the short path's {MAX_ROWS} rows")
    tokens = tokens_per_program(max_query_len, group, block_rows)
    token_blocks = triton.cdiv(max(1, max_query_len), tokens)
    rows = rows_per_program(tokens, group)
    config = config or default_config(query.device)
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    # A verification graph of B sequences carries up to B pad sequences (input_batch._pad), so
    # size the grid from the sequences the tokens can fill (B * q tokens / q), not the rows:
    # counting the pads halves the splits at batch 8 (3 instead of 9).
    busy_seqs = min(num_seqs, triton.cdiv(num_tokens, max(1, max_query_len)))
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_splits = grid_splits(busy_seqs * token_blocks * num_kv_heads, max_context, query.device)
    num_splits = max(1, min(num_splits, MAX_SPLITS))
    d_pad = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        part_out = torch.empty(
            num_tokens, num_heads, num_splits, d_pad, dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused by the kernel without splits
    # (the merge by the sequences' grid, as before token blocks: with them batch 1 at 8 KV heads
    # would count 16 programs and take the fused merge at <= 8 splits, not measured there)
    merge = merge_for(merge, num_splits, busy_seqs * num_kv_heads, query.device)
    merge, counters = fused_counters(merge, query.device, num_seqs * token_blocks * num_kv_heads)
    use_pdl = merge is SplitMerge.PDL
    # Only the fused merge reads SPLITS_PAD / SPLIT_CHUNK (fixed otherwise: no recompiles).
    splits_pad = max(2, triton.next_power_of_2(num_splits)) if merge is SplitMerge.FUSED else 2
    _short_extend_kernel[(num_seqs * token_blocks, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        part_out,
        part_lse,
        out if counters is None else counters,
        scale * LOG2E,
        *paged_attention_strides(query, key_cache, value_cache, block_tables, out),
        head_dim,
        num_heads,
        num_splits,
        IS_SPLIT=num_splits > 1,
        MERGE_FUSED=merge is SplitMerge.FUSED,
        LAUNCH_DEPENDENTS=use_pdl,
        TOKEN_BLOCKS=token_blocks,
        TOKENS=tokens,
        GROUP=group,
        GROUP_P2=triton.next_power_of_2(group),
        PACKED=packs_rows(tokens, group),
        ROWS=rows,
        BLOCK_SIZE=block_size,
        BLOCK_N=config.block_n,
        D_PAD=d_pad,
        SPLITS_PAD=splits_pad,
        SPLIT_CHUNK=fused_split_chunk(rows, d_pad, splits_pad),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if merge in (SplitMerge.KERNEL, SplitMerge.PDL):
        reduce_splits(part_out, part_lse, out, use_pdl=use_pdl)
    return out


def grid_splits(num_programs: int, max_context: int, device: torch.device) -> int:
    """Splits of the context for a grid of num_programs (sequence or token block, KV head)
    programs: decode's rule, at most WIDE_GRID_SPLITS from WIDE_GRID programs (0: no such cap),
    at most SPLIT_CAP (if set)."""
    num_splits = default_num_splits(num_programs, 1, max_context, device)
    if num_programs >= WIDE_GRID and WIDE_GRID_SPLITS > 0:
        num_splits = min(num_splits, WIDE_GRID_SPLITS)
    if SPLIT_CAP > 0:
        num_splits = min(num_splits, SPLIT_CAP)
    return num_splits


def merge_for(merge: SplitMerge | None, num_splits: int, num_programs: int, device: torch.device):
    """The merge a call runs (None without splits): `merge`, else decode's rule for the grid up to
    FUSED_MAX_SPLITS splits and the separate merge above (PDL; KERNEL where unsupported)."""
    if merge is None and num_splits > FUSED_MAX_SPLITS:
        merge = SplitMerge.PDL
    return choose_merge(merge, num_splits, num_programs, device)
