"""Triton paged extend (prefill) attention over a flattened ragged batch.

Grid (num_heads, query tiles, num_seqs): heads vary fastest so the heads sharing a KV head run
side by side and find its K/V tiles in L2. A program takes BLOCK_M new tokens of one sequence and
one head; row i of sequence s sits at position seq_lens[s] - q_len_s + i. Keys below the tile's
first position are visible to every row and run without masks; the diagonal tiles after them
carry the causal mask. K/V are read through the block table: cached prefix and new tokens alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedinfer.kernels import short_extend_attention
from pagedinfer.kernels.launch_args import paged_attention_strides

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class ExtendConfig:
    """Tile shape of the extend kernel."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, n0, row_pos, seq_len, table_row, k_base, v_base, d, d_mask,
    stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
    MASKED: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One BLOCK_N tile of keys at n0: online-softmax update of (acc, m_i, l_i)."""
    pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_mask = pos < seq_len
    block_ids = tl.load(table_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    offsets = pos % BLOCK_SIZE
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k_ptrs = k_base + block_ids[:, None] * stride_kb + offsets[:, None] * stride_ks + d[None, :]
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
    s = tl.dot(q, tl.trans(k)).to(tl.float32) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        visible = (pos[None, :] <= row_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_ptrs = v_base + block_ids[:, None] * stride_vb + offsets[:, None] * stride_vs + d[None, :]
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
    return acc, m_new, l_i


@triton.jit
def _extend_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [NB, BS, KVH, D]
    v_cache_ptr,  # [NB, BS, KVH, D]
    block_tables_ptr,  # int32 [S, MB]
    query_start_loc_ptr,  # int32 [S + 1]
    seq_lens_ptr,  # int32 [S]
    out_ptr,  # [T, H, D]
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bts, stride_ot, stride_oh, head_dim,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)  # longest (last) tiles first
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    m0 = tile * BLOCK_M
    if m0 < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        first_pos = seq_len - q_len + m0  # position of the tile's first row
        rows = m0 + tl.arange(0, BLOCK_M)
        r_mask = rows < q_len
        row_pos = first_pos + tl.arange(0, BLOCK_M)
        d = tl.arange(0, D_PAD)
        d_mask = d < head_dim
        tokens = (q_start + rows).to(tl.int64)
        q_ptrs = q_ptr + tokens[:, None] * stride_qt + head * stride_qh + d[None, :]
        q = tl.load(q_ptrs, mask=r_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, D_PAD]

        kv_head = head // GROUP
        k_base = k_cache_ptr + kv_head * stride_kh
        v_base = v_cache_ptr + kv_head * stride_vh
        table_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        unmasked_end = (first_pos // BLOCK_N) * BLOCK_N  # keys < first_pos are visible to all rows
        for n0 in range(0, unmasked_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, n0, row_pos, seq_len, table_row, k_base, v_base, d, d_mask,
                stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                MASKED=False, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N,
            )  # fmt: skip
        masked_end = tl.minimum(first_pos + BLOCK_M, seq_len)
        for n0 in range(unmasked_end, masked_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, n0, row_pos, seq_len, table_row, k_base, v_base, d, d_mask,
                stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                MASKED=True, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N,
            )  # fmt: skip

        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + tokens[:, None] * stride_ot + head * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def default_config(head_dim: int, max_context: int, device: torch.device) -> ExtendConfig:
    """Tiles measured on an H200 (bench/NOTES.md): wide tiles for long contexts, narrower for
    short ones where causal-mask waste and too few programs dominate. max_context is the block
    table's capacity (host-side, no sync)."""
    if device.type != "cuda":  # interpreter: fewer, wider programs run faster
        return ExtendConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
    if head_dim > 128:
        return ExtendConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if max_context >= 2048:
        return ExtendConfig(block_m=128, block_n=128, num_warps=8, num_stages=2)
    return ExtendConfig(block_m=64, block_n=64, num_warps=4, num_stages=4)


def paged_extend_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    config: ExtendConfig | None = None,
) -> torch.Tensor:
    """query [T, H, D] -> out [T, H, D]; arguments already checked by ops.paged_extend_attention.

    Short chunks (speculative verification: a few tokens a sequence) go to the GQA-packed split-K
    kernel of short_extend_attention unless a config forces this one's tiles.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    if num_tokens == 0 or num_seqs == 0:
        return torch.empty_like(query)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if config is None and short_extend_attention.takes(max_query_len, num_heads, num_kv_heads):
        return short_extend_attention.paged_short_extend_attention(
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len
        )
    config = config or default_config(head_dim, block_tables.shape[1] * block_size, query.device)
    out = torch.empty_like(query)
    num_tiles = triton.cdiv(max(1, max_query_len), config.block_m)
    _extend_kernel[(num_heads, num_tiles, num_seqs)](
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * LOG2E,
        *paged_attention_strides(query, key_cache, value_cache, block_tables, out),
        head_dim,
        GROUP=num_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        D_PAD=max(16, triton.next_power_of_2(head_dim)),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
