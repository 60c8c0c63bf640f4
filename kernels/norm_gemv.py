"""Triton kernels: y = rms_norm(x + residual) @ W.T (+ b) for 1-16 rows, the norm folded into the GEMV.

At a few tokens a step a decoder layer's two RMSNorms are kernels of their own: ~1-2 us each of
launch and two dependent memory round trips for a few KB of math, 60-64 of them a step, on the
critical path between two weight streams. Here the GEMV that consumes the norm applies it; program
0 also writes h = x + residual, the next residual.

Two ways to apply it (`scale_after`):
- before (fp16, and one row only): every program first computes its row's statistics (the row is a
  few KB, one tile from L2), then normalizes each x tile as it streams the weight rows. Same
  rounding steps as fused_reference.add_rms_norm (x_hat rounded to the dtype before the weight).
- after (bf16, 1-16 rows): rms_norm(h) @ W.T = rstd * ((h * g) @ W.T) per row, so each program
  sums h^2 inside the weight loop it runs anyway and scales its accumulator rows by rstd at the
  end. No statistics pass stands in front of the weight stream: the earlier multi-row folds that
  had one were slower than the separate norm (bench/NOTES.md). h * g is rounded to the dtype once
  (the tensor cores' input) where the reference rounds twice, x_hat and x_hat * g; fp16 keeps the
  reference order because h * g, not yet normalized, can overflow its range.
One row runs the `reduce` GEMV of kernels/gemv.py, 2-16 rows its tensor-core `dot` variant.
Greedy speculative decoding relies on the one-row and the multi-row paths rounding alike: in bf16
both scale after.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedinfer.kernels.gemv import GemvConfig

MAX_ROW = 16384  # widest row whose statistics one program computes in a single tile (before)
MAX_ROWS = 16  # the multi-row kernel's rows: one 16-row tensor-core tile
# Where the norm is applied after the GEMV (see the module docstring); fp16 applies it before.
SCALE_AFTER_DTYPES = (torch.bfloat16,)


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
    SCALE_AFTER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_ROW: tl.constexpr,  # the row in one tile (before); unused after
):
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    rstd = 1.0
    if not SCALE_AFTER:  # the statistics first: one pass over the row
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
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)  # (after) h^2, summed across the tiles
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_mask = k < K
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        xk = tl.load(x_ptr + k, mask=k_mask, other=0.0)
        if HAS_RESIDUAL:
            rk_tile = tl.load(residual_ptr + k, mask=k_mask, other=0.0)
            xk = (xk.to(tl.float32) + rk_tile.to(tl.float32)).to(dtype)
            if SCALE_AFTER:  # noqa: SIM102 (a compile-time branch around a run-time one)
                if pid == 0:
                    tl.store(residual_out_ptr + k, xk, mask=k_mask)
        g = tl.load(norm_w_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        if SCALE_AFTER:
            hf = xk.to(tl.float32)
            squares += hf * hf
            x_in = (hf * g).to(dtype).to(tl.float32)
        else:
            x_hat = (xk.to(tl.float32) * rstd).to(dtype).to(tl.float32)
            x_in = (x_hat * g).to(dtype).to(tl.float32)
        acc += w.to(tl.float32) * x_in[None, :]
    y = tl.sum(acc, axis=1)
    if SCALE_AFTER:
        y *= tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(squares, axis=0) / K + eps))
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _add_norm_gemv_rows_kernel(
    x_ptr,  # [M, K] the block output (or the embedding, with no residual)
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
    stride_hm,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # kernels/gemv.py's dot variant on u = h * g, with each row's h^2 summed in the same loop and
    # the accumulator rows scaled by their rstd at the end (the norm applied after).
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    squares = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_mask = k < K
        mk_mask = m_mask[:, None] & k_mask[None, :]
        h = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=mk_mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + rm[:, None] * stride_rm + k[None, :], mask=mk_mask, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(dtype)  # torch rounds x + residual
            if pid == 0:
                tl.store(residual_out_ptr + rm[:, None] * stride_hm + k[None, :], h, mask=mk_mask)
        hf = h.to(tl.float32)
        squares += hf * hf
        g = tl.load(norm_w_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        u = (hf * g[None, :]).to(dtype)
        w = tl.load(
            w_ptr + rn.to(tl.int64)[None, :] * stride_wn + k[:, None],
            mask=n_mask[None, :] & k_mask[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]: W's tile, transposed by the addressing
        acc = tl.dot(u, w, acc)
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(squares, axis=1) / K + eps))
    acc *= rstd[:, None]
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
    scale_after: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [M, K] (residual None: no add), norm_weight [K], weight [N, K] -> (y [M, N], h [M, K]).

    h = x + residual (x itself without a residual) is the next residual. One row takes a `reduce`
    config, 2-16 rows a `dot` config and the norm applied after; `scale_after` None picks it by
    dtype (SCALE_AFTER_DTYPES). Every tensor contiguous in its last dim, one dtype throughout; the
    caller (linear_ops.norm_linear) checks that.
    """
    num_rows, k = x.shape
    n = weight.shape[0]
    if scale_after is None:
        scale_after = x.dtype in SCALE_AFTER_DTYPES
    one_row = num_rows == 1 and config.variant == "reduce" and (scale_after or k <= MAX_ROW)
    rows = 1 < num_rows <= MAX_ROWS and config.variant == "dot" and scale_after
    if not (one_row or rows):
        raise ValueError(
            f"add_norm_gemv takes one row (a reduce config; at most {MAX_ROW} wide unless scaled "
            f"after) or 2-{MAX_ROWS} rows (a dot config, scaled after), got {tuple(x.shape)}, "
            f"{config.variant}, scale_after={scale_after}"
        )
    y = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    has_residual = residual is not None
    residual_out = torch.empty_like(x, memory_format=torch.contiguous_format) if has_residual else x
    operands = (
        x,
        residual if has_residual else x,
        norm_weight,
        weight,
        bias if bias is not None else y,
        y,
        residual_out,
    )
    grid = (triton.cdiv(n, config.block_n),)
    tiles = dict(
        HAS_RESIDUAL=has_residual,
        HAS_BIAS=bias is not None,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if one_row:
        _add_norm_gemv_kernel[grid](
            *operands,
            n,
            k,
            weight.stride(0),
            float(eps),
            SCALE_AFTER=scale_after,
            BLOCK_ROW=triton.next_power_of_2(k) if not scale_after else 1,
            **tiles,
        )
    else:
        _add_norm_gemv_rows_kernel[grid](
            *operands,
            num_rows,
            n,
            k,
            x.stride(0),
            residual.stride(0) if has_residual else 0,
            weight.stride(0),
            y.stride(0),
            residual_out.stride(0),
            float(eps),
            BLOCK_M=16,
            **tiles,
        )
    return y, residual_out
