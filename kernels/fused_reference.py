"""Pure-PyTorch references of the fused elementwise kernels; also the CPU production path.

Each function computes exactly what the model layers computed before fusion (same op order, same
dtype round trips), so the CPU path keeps its numerics bit for bit. The Triton kernels
(rms_norm.py, rotary_cache.py, silu_mul.py) follow the same rounding steps:
  RMSNorm:  h = x + residual (in x's dtype); n = (h_f32 * rsqrt(mean(h_f32^2) + eps)).to(dtype);
            out = weight * n
  rotary:   (x1, x2) halves in fp32 -> (x1 c - x2 s, x2 c + x1 s), back to x's dtype
  SwiGLU:   silu(gate) (fp32 math, rounded to dtype) * up
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedinfer.kernels import reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N], weight [N] -> weight * norm(x); statistics in fp32, rounded to x's dtype first."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)  # [T, N] fp32
    return weight * normed.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, residual) [T, N] -> (rms_norm(h), h) with h = x + residual (the next residual)."""
    hidden = x + residual  # [T, N]
    return rms_norm(hidden, weight, eps), hidden


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] (int), inv_freq [D/2] fp32 -> (cos, sin) [T, D/2] fp32."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    return freqs.cos(), freqs.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by (cos, sin) [T, D/2]: halves (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
    x1, x2 = x.float().chunk(2, dim=-1)  # [T, H, D/2] each
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, D/2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def rotary_cache_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    write_kv_cache=None,
) -> torch.Tensor:
    """qkv [T, (H + 2 KVH) D] -> rotated q [T, H, D]; rotated k and v go into the caches' slots.

    Caches [num_blocks, block_size, KVH, D]; cos/sin [T, D/2] fp32; slot_mapping [T].
    `write_kv_cache(k, v, key_cache, value_cache, slot_mapping)` does the cache write (default:
    the reference scatter; the GPU fallback passes the Triton cache-write kernel).
    """
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    num_heads = qkv.shape[1] // head_dim - 2 * num_kv_heads
    qk, v = qkv.split([(num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim], dim=-1)
    # q and k rotate together: one pass over [T, H + KVH, D].
    qk = apply_rotary(qk.view(num_tokens, num_heads + num_kv_heads, head_dim), cos, sin)
    q, k = qk.split([num_heads, num_kv_heads], dim=1)  # [T, H, D], [T, KVH, D]
    v = v.view(num_tokens, num_kv_heads, head_dim)  # [T, KVH, D]
    (write_kv_cache or reference.write_kv_cache)(k, v, key_cache, value_cache, slot_mapping)
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 I] (rows [gate; up]) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
    return F.silu(gate) * up
