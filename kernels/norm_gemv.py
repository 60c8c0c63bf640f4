"""Triton kernels: y = rms_norm(x + residual) @ W.T (+ b) for 1-16 rows, the norm folded into the GEMV.

At one token a step a decoder layer's two RMSNorms are one-program kernels: ~2 us each of launch
and two dependent memory round trips for 8 KB of math, 64 of them a step on an 8B model, on the
critical path between two weight streams. Here every program of the GEMV that consumes the norm
recomputes the row's statistics itself (the row is a few KB, read from L2) and normalizes each
x tile as it streams its weight rows; program 0 also writes h = x + residual, the next residual.

Same rounding steps as fused_reference.add_rms_norm (h rounded to x's dtype, fp32 statistics,
x_hat rounded to the dtype before the weight, the product rounded again), then the GEMV of
kernels/gemv.py's `reduce` variant; only the order of the fp32 sums differs from the two-kernel
path. 2-16 rows (small decode batches, speculative verification) take the `dot` variant with the
same folding; their statistics are a pass over K in BLOCK_K tiles before the weight stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedinfer.kernels.gemv import GemvConfig

MAX_ROW = 16384  # widest row whose statistics one program computes in a single tile
MAX_DOT_ROWS = 16  # rows of the multi-row kernel (its statistics pass walks K in BLOCK_K tiles)


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


@triton.jit
def _add_norm_gemv_dot_kernel(
    x_ptr,  # [M, K]
    residual_ptr,  # [M, K] (unused without HAS_RESIDUAL)
    norm_w_ptr,  # [K]
    w_ptr,  # [N, K]
    b_ptr,  # [N] or a dummy
    y_ptr,  # [M, N]
    residual_out_ptr,  # [M, K] (unused without HAS_RESIDUAL)
    M,
    N,
    K,
    stride_xm,
    stride_rm,
    stride_wn,
    stride_ym,
    stride_om,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """2-16 rows: a statistics pass over each row's K (from L2, program 0 writing h), then the
    `dot` GEMV of kernels/gemv.py on the normalized tiles. Rounding as in the one-row kernel."""
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        mk_mask = m_mask[:, None] & (k < K)[None, :]
        h = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=mk_mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + rm[:, None] * stride_rm + k[None, :], mask=mk_mask, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(dtype)  # torch rounds x + residual
            if pid == 0:
                tl.store(residual_out_ptr + rm[:, None] * stride_om + k[None, :], h, mask=mk_mask)
        hf = h.to(tl.float32)
        sum_sq += tl.sum(hf * hf, axis=1)
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(sum_sq / K + eps))  # [BLOCK_M]

    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_mask = k < K
        mk_mask = m_mask[:, None] & k_mask[None, :]
        xk = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=mk_mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + rm[:, None] * stride_rm + k[None, :], mask=mk_mask, other=0.0)
            xk = (xk.to(tl.float32) + r.to(tl.float32)).to(dtype)
        x_hat = (xk.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
        g = tl.load(norm_w_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        x_in = (x_hat * g[None, :]).to(dtype)
        w = tl.load(
            w_ptr + rn.to(tl.int64)[None, :] * stride_wn + k[:, None],
            mask=n_mask[None, :] & k_mask[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x_in, w, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def add_norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [M, K] (residual None: no add), norm_weight [K], weight [N, K] -> (y [M, N], h [M, K]).

    One row with a `reduce` config, or 2-MAX_DOT_ROWS rows with a `dot` config. h = x + residual
    (x itself without a residual) is the next residual. Every tensor contiguous in its last dim,
    one dtype throughout; the caller (linear_ops.norm_linear) checks that.
    """
    num_rows, k = x.shape
    n = weight.shape[0]
    one_row = num_rows == 1 and k <= MAX_ROW and config.variant == "reduce"
    if not one_row and not (1 <= num_rows <= MAX_DOT_ROWS and config.variant == "dot"):
        raise ValueError(
            f"add_norm_gemv takes one row of at most {MAX_ROW} with a reduce config or up to "
            f"{MAX_DOT_ROWS} rows with a dot config, got {tuple(x.shape)} and {config.variant}"
        )
    y = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    has_residual = residual is not None
    residual_out = torch.empty_like(x, memory_format=torch.contiguous_format) if has_residual else x
    common = dict(
        HAS_RESIDUAL=has_residual,
        HAS_BIAS=bias is not None,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    grid = (triton.cdiv(n, config.block_n),)
    res = residual if has_residual else x
    b = bias if bias is not None else y
    if one_row:
        _add_norm_gemv_kernel[grid](
            x, res, norm_weight, weight, b, y, residual_out, n, k, weight.stride(0), float(eps),
            BLOCK_ROW=triton.next_power_of_2(k), **common,
        )  # fmt: skip
    else:
        _add_norm_gemv_dot_kernel[grid](
            x, res, norm_weight, weight, b, y, residual_out, num_rows, n, k,
            x.stride(0), res.stride(0), weight.stride(0), y.stride(0), residual_out.stride(0), float(eps),
            BLOCK_M=max(16, triton.next_power_of_2(num_rows)), **common,
        )  # fmt: skip
    return y, residual_out
