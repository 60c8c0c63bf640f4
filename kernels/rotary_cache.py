"""Triton kernel: rotary embedding of q and k fused with the paged KV-cache write.

Reads the qkv GEMM output once. Grid (tokens, head groups): a program takes HEADS consecutive
heads of one token among the H + 2 KVH heads of its row; q heads are rotated into the q output,
k heads are rotated into the key cache, v heads are copied into the value cache (masked stores
pick each head's destination). Half-split ("NeoX") layout; rounding as fused_reference.apply_rotary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedinfer.kernels.decode_merge import gdc_launch_dependents, pdl_supported

HEADS = 8  # heads per program: Llama-3-8B's 48 heads -> 6 programs per token


@triton.jit
def _rotary_cache_kernel(
    qkv_ptr,  # [T, (H + 2 KVH) D]
    cos_ptr,  # [T, D/2] fp32
    sin_ptr,  # [T, D/2] fp32
    q_ptr,  # [T, H, D] out
    key_cache_ptr,  # [NB, BS, KVH, D]
    value_cache_ptr,  # [NB, BS, KVH, D]
    slot_ptr,  # [T]
    stride_qkv,
    stride_cos,
    stride_sin,
    stride_qt,
    stride_qh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
):
    if LAUNCH_DEPENDENTS:  # a PDL decode (pdl_prologue) may start; it waits before reading q / new K/V
        gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)[:, None]  # [HEADS, 1]
    d = tl.arange(0, HALF_PAD)[None, :]  # [1, HALF_PAD]
    in_row = (head < num_heads + 2 * num_kv_heads) & (d < HALF)
    src = qkv_ptr + token * stride_qkv + head * (2 * HALF) + d
    x1 = tl.load(src, mask=in_row, other=0.0)
    x2 = tl.load(src + HALF, mask=in_row, other=0.0)
    c = tl.load(cos_ptr + token * stride_cos + d, mask=d < HALF, other=0.0)  # [1, HALF_PAD]
    s = tl.load(sin_ptr + token * stride_sin + d, mask=d < HALF, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    rot1 = (a * c - b * s).to(qkv_ptr.dtype.element_ty)
    rot2 = (b * c + a * s).to(qkv_ptr.dtype.element_ty)

    is_q = in_row & (head < num_heads)
    q_dst = q_ptr + token * stride_qt + head * stride_qh + d
    tl.store(q_dst, rot1.to(q_ptr.dtype.element_ty), mask=is_q)
    tl.store(q_dst + HALF, rot2.to(q_ptr.dtype.element_ty), mask=is_q)

    slot = tl.load(slot_ptr + token).to(tl.int64)
    block_id, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    kv_head = head - num_heads  # k heads: [0, KVH); v heads: [KVH, 2 KVH)
    is_k = in_row & (kv_head >= 0) & (kv_head < num_kv_heads)
    k_dst = key_cache_ptr + block_id * stride_kcb + offset * stride_kcs + kv_head * stride_kch + d
    tl.store(k_dst, rot1.to(key_cache_ptr.dtype.element_ty), mask=is_k)
    tl.store(k_dst + HALF, rot2.to(key_cache_ptr.dtype.element_ty), mask=is_k)
    is_v = in_row & (kv_head >= num_kv_heads)
    v_head = kv_head - num_kv_heads
    v_dst = value_cache_ptr + block_id * stride_vcb + offset * stride_vcs + v_head * stride_vch + d
    tl.store(v_dst, x1.to(value_cache_ptr.dtype.element_ty), mask=is_v)
    tl.store(v_dst + HALF, x2.to(value_cache_ptr.dtype.element_ty), mask=is_v)


def rotary_cache_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """qkv [T, (H + 2 KVH) D] -> rotated q [T, H, D]; rotated k and v written at slot_mapping [T]."""
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    num_heads = qkv.shape[1] // head_dim - 2 * num_kv_heads
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    grid = (num_tokens, triton.cdiv(num_heads + 2 * num_kv_heads, HEADS))
    _rotary_cache_kernel[grid](
        qkv,
        cos,
        sin,
        q,
        key_cache,
        value_cache,
        slot_mapping,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        q.stride(0),
        q.stride(1),
        *key_cache.stride()[:3],
        *value_cache.stride()[:3],
        num_heads,
        num_kv_heads,
        HALF=head_dim // 2,
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
        HEADS=HEADS,
        BLOCK_SIZE=key_cache.shape[1],
        LAUNCH_DEPENDENTS=pdl_supported(qkv.device),
        num_warps=4,
        enable_fp_fusion=False,  # no FMA: x1 c - x2 s rounds like the separate torch ops
    )
    return q
