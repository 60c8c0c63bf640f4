"""Triton kernel: y = rms_norm(x + residual) @ W.T (+ b) for one row, the norm folded into the GEMV.

At one token a step a decoder layer's two RMSNorms are one-program kernels: ~2 us each of launch
and two dependent memory round trips for 8 KB of math, 64 of them a step on an 8B model, on the
critical path between two weight streams. Here every program of the GEMV that consumes the norm
recomputes the row's statistics itself (the row is a few KB, read from L2) and normalizes each
x tile as it streams its weight rows; program 0 also writes h = x + residual, the next residual.

Same rounding steps as fused_reference.add_rms_norm (h rounded to x's dtype, fp32 statistics,
x_hat rounded to the dtype before the weight, the product rounded again), then the GEMV of
kernels/gemv.py's `reduce` variant; only the order of the fp32 sums differs from the two-kernel
path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedinfer.kernels.gemv import GemvConfig

MAX_ROW = 16384  # widest row whose statistics one program computes in a single tile


@triton.jit
def _add_norm_gemv_kernel(
    x_ptr,  # [K] the block output (or the embedding, with no residual)
    residual_ptr,  # [K] (unused without HAS_RESIDUAL)
    norm_w_ptr,  # [K]
    w_ptr,  # [N, K]
    b_ptr,  # [N] or a dummy
    y_ptr,  # [N]
    residual_out_ptr,  # [K] (unused without HAS_RESIDUAL)
    N,
    K,
    stride_wn,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
):
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_ROW)
    col_mask = cols < K
    h = tl.load(x_ptr + cols, mask=col_mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + cols, mask=col_mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(dtype)  # torch rounds x + residual
        if pid == 0:
            tl.store(residual_out_ptr + cols, h, mask=col_mask)
    hf = h.to(tl.float32)
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(hf * hf, axis=0) / K + eps))

    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_mask = k < K
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        xk = tl.load(x_ptr + k, mask=k_mask, other=0.0)
        if HAS_RESIDUAL:
            rk_tile = tl.load(residual_ptr + k, mask=k_mask, other=0.0)
            xk = (xk.to(tl.float32) + rk_tile.to(tl.float32)).to(dtype)
        x_hat = (xk.to(tl.float32) * rstd).to(dtype).to(tl.float32)
        g = tl.load(norm_w_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        x_in = (x_hat * g).to(dtype).to(tl.float32)
        acc += w.to(tl.float32) * x_in[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def add_norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [1, K] (residual None: no add), norm_weight [K], weight [N, K] -> (y [1, N], h [1, K]).

    h = x + residual (x itself without a residual) is the next residual. Every tensor contiguous
    in its last dim, one dtype throughout; the caller (linear_ops.norm_linear) checks that.
    """
    num_rows, k = x.shape
    n = weight.shape[0]
    if num_rows != 1 or k > MAX_ROW or config.variant != "reduce":
        raise ValueError(
            f"add_norm_gemv takes one row of at most {MAX_ROW} and a reduce config, got {x.shape}"
        )
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    has_residual = residual is not None
    residual_out = torch.empty_like(x, memory_format=torch.contiguous_format) if has_residual else x
    _add_norm_gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x,
        residual if has_residual else x,
        norm_weight,
        weight,
        bias if bias is not None else y,
        y,
        residual_out,
        n,
        k,
        weight.stride(0),
        float(eps),
        HAS_RESIDUAL=has_residual,
        HAS_BIAS=bias is not None,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        BLOCK_ROW=triton.next_power_of_2(k),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return y, residual_out
