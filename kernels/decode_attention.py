"""Triton paged decode attention: GQA-grouped, split-K ("flash-decoding"), partials merged after.

Grid (num_seqs, num_kv_heads, num_splits). A program holds the GROUP query heads that share one
KV head (padded to >= 16 rows for tl.dot), reads its share of the sequence's tokens straight
from the paged cache through the block table (no gather copy), and keeps an online softmax in
fp32. Each KV tile is loaded once for the whole group. With num_splits > 1 every split writes a
normalized partial output and its log-sum-exp (base 2); kernels/decode_merge.py merges them
(a second kernel, the same launched as a programmatic dependent, or the last split in-kernel).
With DecodeConfig.pdl_prologue the kernel itself is a programmatic dependent of the kernel before
it (see there for what it may read before gdc_wait).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedinfer.kernels.decode_merge import (
    CounterPool,
    SplitMerge,
    fused_split_chunk,
    gdc_launch_dependents,
    gdc_wait,
    merge_group,
    pdl_supported,
    reduce_splits,
)
from pagedinfer.kernels.launch_args import paged_attention_strides

LOG2E = 1.4426950408889634
MAX_SPLITS = 128  # hard cap (merge tiles are [SPLITS_PAD, D_PAD]); the default rule stays <= 64
DEFAULT_MAX_SPLITS = 64
MIN_TOKENS_PER_SPLIT = 64
SMALL_GRID = 16  # fewer (sequence, KV head) programs than this: latency-bound (batch 1 at 8 KV heads)
SMALL_GRID_MIN_CONTEXT = 2048  # block-table capacity from which the small-grid config pays (v5)


# The fused merge's arrival counters: one zeroed buffer per device, kept for the process's life
# because CUDA graphs hold its address (see decode_merge.CounterPool).
FUSED_COUNTERS = CounterPool()


@dataclass(frozen=True)
class DecodeConfig:
    """Tile shape of the decode kernel (BLOCK_N tokens per iteration) and its split-K merge.

    merge None: default_merge picks from the grid size.
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    merge: SplitMerge | None = None
    # ptxas register cap (Triton's maxnreg): ptxas gives the v3 tile ~210-255 registers a thread,
    # which allows only 2 programs of 4 warps per SM; a cap trades a few spills for occupancy.
    maxnreg: int | None = None
    # Split bounds from the block table's capacity (a host-side bound) instead of each context
    # length: a program's first block ids load without waiting for the context-length load. Off
    # by default: with q_in_loop it gains 4% where tables fit the context (1x8192 16.3 -> 15.6
    # us) but loses 16-60% where contexts are far shorter than the table (NOTES.md v5).
    capacity_splits: bool = False
    # Load the query tile inside the loop: the pipeliner fetches it with the first K/V tile
    # instead of the program stalling on it before its first block-id load.
    q_in_loop: bool = False
    # default_num_splits: at least this many tokens a split
    min_split_tokens: int = 64
    # Launch as a programmatic dependent of the kernel before (where pdl_supported): each program
    # loads its context length, first tile's block ids and K/V before gdc_wait, so launch and
    # first DRAM round trip overlap that kernel's tail. Contract: the kernels it may overlap write
    # at most the query and the K/V at each sequence's last position (context_len - 1), as the
    # engine's rotary + cache write does; all else it reads must be older. Elsewhere (CPU
    # interpreter, pre-Hopper) the same peeled first tile runs without the wait, in stream order.
    pdl_prologue: bool = False
    # Load the next tile's block ids while the current tile's K/V are in flight (one tile ahead,
    # BLOCK_N ids in registers), so each tile after the first costs one dependent DRAM round
    # trip (K/V) instead of two (block ids, then K/V). On in bounded_config (told small grids:
    # 1x8192 15.69 -> 15.08 us with 32-token tiles at 2 warps, 1x512 5.83 -> 5.64), off elsewhere:
    # it costs 8% on the 64-token 4-warp tile at 1x8192 and 2-22% on large grids (64x2048 138 ->
    # 168 us), where the extra live registers cost occupancy; NOTES.md v9-v10.
    prefetch_ids: bool = False


@triton.jit
def tile_block_ids(table_row, pos, stop, BLOCK_SIZE: tl.constexpr):
    """int64 cache block of each token position in pos [BLOCK_N] (0 from stop on)."""
    return tl.load(table_row + pos // BLOCK_SIZE, mask=pos < stop, other=0).to(tl.int64)


@triton.jit
def load_kv_tile(base, ids, pos, n_mask, d, d_mask, stride_b, stride_s, BLOCK_SIZE: tl.constexpr):
    """A K or V tile [BLOCK_N, D_PAD] of the token positions pos (zero rows where not n_mask)."""
    ptrs = base + ids[:, None] * stride_b + (pos % BLOCK_SIZE)[:, None] * stride_s + d[None, :]
    return tl.load(ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def _softmax_step(q, k, n_mask, m_i, l_i, qk_scale, EMPTY_TILES: tl.constexpr):
    """Scores of q [GROUP_PAD, D_PAD] against a K tile [BLOCK_N, D_PAD], online softmax in base 2:
    the tile's probabilities p, the rescale alpha of the old accumulator, the new max and sum.
    EMPTY_TILES: a tile may hold no key while none came before (max -inf: subtract 0, not -inf)."""
    s = tl.dot(q, tl.trans(k)).to(tl.float32) * qk_scale  # [GROUP_PAD, BLOCK_N]
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new) if EMPTY_TILES else m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _decode_kernel(
    q_ptr,  # [S, H, D]
    k_cache_ptr,  # [NB, BS, KVH, D]
    v_cache_ptr,  # [NB, BS, KVH, D]
    block_tables_ptr,  # int32 [S, MB]
    context_lens_ptr,  # int32 [S]
    out_ptr,  # [S, H, D] (written when not IS_SPLIT)
    part_out_ptr,  # fp32 [S, H, num_splits, D_PAD] (written when IS_SPLIT)
    part_lse_ptr,  # fp32 [S, H, num_splits]
    counter_ptr,  # int32 [>= S * KVH], zero on entry and on exit (MERGE_FUSED only)
    qk_scale,  # softmax scale * log2(e)
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bts,
    stride_os,
    stride_oh,
    head_dim,
    num_splits,
    capacity,  # bound on the context lengths: table columns * BLOCK_SIZE or max_context_len
    IS_SPLIT: tl.constexpr,
    MERGE_FUSED: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr,
    CAPACITY_SPLITS: tl.constexpr,
    Q_IN_LOOP: tl.constexpr,
    PDL_PROLOGUE: tl.constexpr,
    GDC_WAIT: tl.constexpr,
    PREFETCH_IDS: tl.constexpr,
):
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()  # the PDL merge kernel may be scheduled now; it waits for our results
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    if CAPACITY_SPLITS:  # the loop and the block-id loads need no context_len: it arrives meanwhile
        per_split = tl.cdiv(tl.cdiv(capacity, num_splits), BLOCK_N) * BLOCK_N
        start = split * per_split
        stop = tl.minimum(start + per_split, capacity)  # tiles [start, stop); keys below end
        end = tl.minimum(stop, context_len)
    else:
        per_split = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, context_len)
        stop = end

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + g  # [GROUP_PAD]
    g_mask = g < GROUP
    d_mask = d < head_dim
    q_ptrs = q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + d[None, :]
    q_mask = g_mask[:, None] & d_mask[None, :]
    if not Q_IN_LOOP and not PDL_PROLOGUE:
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)  # [GROUP_PAD, D_PAD]

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    loop_start = start
    if PDL_PROLOGUE:  # the first tile, peeled: its loads (but the newest token's) precede gdc_wait
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        ids = tile_block_ids(table_row, pos, stop, BLOCK_SIZE)  # block tables: host copies, older
        old = pos < tl.minimum(end, context_len - 1)
        k = load_kv_tile(k_base, ids, pos, old, d, d_mask, stride_kb, stride_ks, BLOCK_SIZE)
        v = load_kv_tile(v_base, ids, pos, old, d, d_mask, stride_vb, stride_vs, BLOCK_SIZE)
        if GDC_WAIT:
            gdc_wait()  # the kernel before is complete, its writes visible; every store comes after
        # what it may have written: the query and the newest token's K/V (rows zero in k, v so far)
        new = (pos == context_len - 1) & (pos < end)
        k += load_kv_tile(k_base, ids, pos, new, d, d_mask, stride_kb, stride_ks, BLOCK_SIZE)
        v += load_kv_tile(v_base, ids, pos, new, d, d_mask, stride_vb, stride_vs, BLOCK_SIZE)
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)
        p, alpha, m_i, l_i = _softmax_step(q, k, pos < end, m_i, l_i, qk_scale, True)  # may be empty
        acc = tl.dot(p.to(v.dtype), v).to(tl.float32)
        loop_start = start + BLOCK_N
    if PREFETCH_IDS:
        ids_next = tile_block_ids(table_row, loop_start + tl.arange(0, BLOCK_N), stop, BLOCK_SIZE)
    for n0 in range(loop_start, stop, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        if Q_IN_LOOP and not PDL_PROLOGUE:  # in the loop (not hoisted): pipelined with K/V
            q = tl.load(q_ptrs, mask=q_mask & (g * 0 + n0 < stop)[:, None], other=0.0)
        if PREFETCH_IDS:  # this tile's ids came one iteration early; fetch the next tile's now
            ids = ids_next
            # masked off past stop (the table's width at most): the last iteration reads nothing
            ids_next = tile_block_ids(table_row, pos + BLOCK_N, stop, BLOCK_SIZE)
        else:
            ids = tile_block_ids(table_row, pos, stop, BLOCK_SIZE)
        k = load_kv_tile(k_base, ids, pos, pos < end, d, d_mask, stride_kb, stride_ks, BLOCK_SIZE)
        p, alpha, m_i, l_i = _softmax_step(q, k, pos < end, m_i, l_i, qk_scale, CAPACITY_SPLITS)
        v = load_kv_tile(v_base, ids, pos, pos < end, d, d_mask, stride_vb, stride_vs, BLOCK_SIZE)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)

    has_keys = l_i > 0.0
    out = tl.where(has_keys[:, None], acc / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
    if not IS_SPLIT:
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        row = (seq.to(tl.int64) * GROUP * tl.num_programs(1) + heads) * num_splits + split  # [GROUP_PAD]
        tl.store(part_out_ptr + row[:, None] * D_PAD + d[None, :], out, mask=g_mask[:, None])
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)
        if MERGE_FUSED:
            tl.debug_barrier()  # every thread's partial stores precede the release below
            counter = counter_ptr + seq * tl.num_programs(1) + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:  # the last split of this (seq, kv_head) merges them all
                merge_group(
                    part_out_ptr, part_lse_ptr, out_ptr, seq, kv_head, GROUP * tl.num_programs(1),
                    stride_os, stride_oh, head_dim, num_splits,
                    GROUP, GROUP_P2, SPLITS_PAD, SPLIT_CHUNK, D_PAD,
                )  # fmt: skip
                tl.store(counter, 0)  # zero again for the next call (and the next graph replay)


def default_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_context: int,
    device: torch.device,
    min_tokens: int = MIN_TOKENS_PER_SPLIT,
) -> int:
    """Split-K factor from the grid size alone (H200 sweeps in bench/NOTES.md):

    - >= 2 waves of programs without splitting: 1 (plain streaming is at the copy bandwidth);
    - tiny grids (< 64 programs, e.g. batch 1-7 at 8 KV heads) are latency-bound: aim at ~4
      waves, at least min_tokens a split (64; 32 in the small-grid config; batch 1: 8 / 64 / 64
      splits at 512 / 2048 / 8192);
    - in between aim at ~2 waves (batch 16: 3 splits; 5 measured 25% slower, a partial wave).

    max_context is a host-side bound (the block table's width times block_size), so the choice
    never needs a device sync and stays fixed for a CUDA-graph batch bucket.
    """
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    programs = max(1, num_seqs * num_kv_heads)
    if programs >= 2 * num_sms:
        return 1
    waves = 4 if programs < 64 else 2
    splits = min(
        triton.cdiv(waves * num_sms, programs),
        triton.cdiv(max_context, min_tokens),
        DEFAULT_MAX_SPLITS,
    )
    return max(1, splits)


def default_merge(num_programs: int, device: torch.device) -> SplitMerge:
    """The split-K merge for a grid of num_programs (sequence, KV head) pairs (H200, NOTES.md v4).

    Batch 1 (< 16 programs): PDL (1x512 6.8 -> 6.1 us, 1x8192 16.8 -> 16.3 us; 1x2048 within
    noise). Other split grids: FUSED (16x2048 45.8 -> 44.3 us, 4x8192 45.8 -> 45.5, where PDL
    measured 47-48 us in two of three runs). The CPU interpreter keeps KERNEL.
    """
    if device.type != "cuda":
        return SplitMerge.KERNEL
    return SplitMerge.PDL if num_programs < 16 else SplitMerge.FUSED


def fused_counters(merge: SplitMerge | None, device: torch.device, num_counters: int):
    """(merge, counters): the FUSED merge's zeroed arrival counters (decode, short extend), or
    None; a FUSED merge whose counters do not fit FUSED_COUNTERS runs the KERNEL merge instead."""
    if merge is not SplitMerge.FUSED:
        return merge, None
    counters = FUSED_COUNTERS.get(device, num_counters)
    return (merge, counters) if counters is not None else (SplitMerge.KERNEL, None)


def choose_merge(merge: SplitMerge | None, num_splits: int, num_programs: int, device: torch.device):
    """The merge a split kernel's call runs (decode, short extend): `merge`, or default_merge's
    for the grid when None; None without splits; PDL falls back to KERNEL where unsupported."""
    if num_splits == 1:
        return None
    merge = merge or default_merge(num_programs, device)
    if merge is SplitMerge.PDL and not pdl_supported(device):
        return SplitMerge.KERNEL
    return merge


def bounded_config(head_dim: int, device: torch.device, num_programs: int, bound: int) -> DecodeConfig | None:
    """The small-grid config when the caller states a bound on every context length
    (`max_context_len`, as vLLM's max_seq_len): split bounds follow the bound, so each program's
    first block-id loads need not wait for its context length, and the next tile's block ids load
    one tile early. H200, 3 interleaved rounds (NOTES.md v10): bounds >= 2048 take 32-token tiles
    at 2 warps (1x8192 15.08 us vs 15.69 for v7's 64-token tiles, 1x2048 8.00 vs 8.19); shorter
    bounds the 64-token tiles (1x512 5.64 vs 5.83). None where the unbounded default applies
    (large grids, other head dims)."""
    if device.type != "cuda" or num_programs >= SMALL_GRID or head_dim != 128:
        return None
    if bound >= SMALL_GRID_MIN_CONTEXT:
        return DecodeConfig(
            block_n=32,
            num_warps=2,
            q_in_loop=True,
            min_split_tokens=32,
            capacity_splits=True,
            prefetch_ids=True,
        )
    return DecodeConfig(block_n=64, q_in_loop=True, capacity_splits=True, prefetch_ids=True)


def default_config(
    head_dim: int, device: torch.device, num_programs: int | None = None, max_context: int = 0
) -> DecodeConfig:
    """Tiles for head_dim; for num_programs (sequences x KV heads) < SMALL_GRID with a block table
    of >= SMALL_GRID_MIN_CONTEXT tokens (max_context), the latency config of NOTES.md v5: 32-token
    tiles, >= 32 tokens a split, query loaded in the loop (H200, head_dim 128: 1x2048 9.8 -> 8.4
    us, 1x8192 16.3 -> 16.0 us; 1x512 keeps the 64-token tiles, where 32 measured 4% slower),
    pdl_prologue stays opt-in: on the H200 it lost at 1x8192 (16.3 vs 15.9 us) and after the
    rotary kernel (the engine's sequence: 17.9 -> 20.5 us), NOTES.md v6."""
    if device.type != "cuda":  # interpreter: wide tiles mean fewer interpreted iterations
        return DecodeConfig(block_n=32, num_warps=4, num_stages=1)
    if head_dim > 128:
        return DecodeConfig(block_n=32, num_warps=4, num_stages=2)
    small = num_programs is not None and num_programs < SMALL_GRID
    if small and head_dim == 128 and max_context >= SMALL_GRID_MIN_CONTEXT:
        return DecodeConfig(block_n=32, q_in_loop=True, min_split_tokens=32)
    return DecodeConfig()


def launcher_config(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    max_context_len: int | None = None,
    config: DecodeConfig | None = None,
) -> tuple[DecodeConfig, int]:
    """The config `paged_decode_attention` runs (`config`, else the bounded or default pick) and
    the host-side bound on the contexts its splits are sized from."""
    num_seqs, _, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    max_context = block_tables.shape[1] * block_size
    if max_context_len is not None and max_context > 0:  # a table with no columns reads nothing
        max_context = min(max_context, max_context_len)
        config = config or bounded_config(head_dim, query.device, num_seqs * num_kv_heads, max_context)
    config = config or default_config(head_dim, query.device, num_seqs * num_kv_heads, max_context)
    return config, max_context


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """query [S, H, D] -> out [S, H, D]; arguments already checked by ops.paged_decode_attention.

    max_context_len: a host-side bound on every context length (callers that know it: eager
    steps, benchmarks); it must not be below any of them. None: the block table's capacity.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    config, max_context = launcher_config(query, key_cache, block_tables, max_context_len, config)
    if num_splits is None:
        num_splits = default_num_splits(
            num_seqs, num_kv_heads, max_context, query.device, config.min_split_tokens
        )
    num_splits = min(num_splits, MAX_SPLITS)
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    d_pad = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        part_out = torch.empty(
            num_seqs, num_heads, num_splits, d_pad, dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused by the kernel without splits
    merge = choose_merge(config.merge, num_splits, num_seqs * num_kv_heads, query.device)
    gdc = config.pdl_prologue and pdl_supported(query.device)  # else: no wait, plain stream order
    merge, counters = fused_counters(merge, query.device, num_seqs * num_kv_heads)
    # Only the fused merge reads SPLITS_PAD / SPLIT_CHUNK: one fixed value each keeps the kernel
    # from recompiling per split count (its loop over splits is dynamic; the lse tile is small).
    splits_pad = MAX_SPLITS if merge is SplitMerge.FUSED else 2
    group_p2 = triton.next_power_of_2(group)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        out,
        part_out,
        part_lse,
        out if counters is None else counters,
        scale * LOG2E,
        *paged_attention_strides(query, key_cache, value_cache, block_tables, out),
        head_dim,
        num_splits,
        max_context,
        IS_SPLIT=num_splits > 1,
        MERGE_FUSED=merge is SplitMerge.FUSED,
        LAUNCH_DEPENDENTS=merge is SplitMerge.PDL,
        SPLITS_PAD=splits_pad,
        SPLIT_CHUNK=fused_split_chunk(group_p2, d_pad, splits_pad),
        GROUP=group,
        GROUP_P2=group_p2,
        GROUP_PAD=max(16, group_p2),
        BLOCK_SIZE=block_size,
        BLOCK_N=config.block_n,
        D_PAD=d_pad,
        CAPACITY_SPLITS=config.capacity_splits,
        Q_IN_LOOP=config.q_in_loop,
        PDL_PROLOGUE=config.pdl_prologue,
        PREFETCH_IDS=config.prefetch_ids,
        GDC_WAIT=gdc,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **({} if config.maxnreg is None else {"maxnreg": config.maxnreg}),
        **({"launch_pdl": True} if gdc else {}),
    )
    if merge in (SplitMerge.KERNEL, SplitMerge.PDL):
        reduce_splits(part_out, part_lse, out, use_pdl=merge is SplitMerge.PDL)
    return out
