"""Triton kernels: the RMSNorm between two GEMVs carried by their epilogues (2-64 rows, bf16).

A verification step of a few tokens a sequence runs each decoder layer's GEMVs at 2-64 rows, and
in front of qkv and gate_up sits an RMSNorm: a kernel of its own (~1.6 us in a graph at SmolLM2's
shapes), 60 a step. Folding it into the next GEMV's loop is slower than the launch it saves (the
tensor cores want x as loaded: bench/NOTES.md, session 21). Here nothing touches x inside a loop:

- `add_prenorm` (o_proj, down: the GEMV before a norm): y = x @ W.T, then in its epilogue
  h = y + residual (rounded as torch rounds the two-step add), u = h * g (g the next norm's weight)
  and, per program, the sum of h^2 over its N tile for each row: partials [column tiles, R] fp32
  (R the rows rounded up to 16, 32 or 64; a program of a row block writes its rows' slice).
- `rstd_linear` (qkv, gate_up: the GEMV after it): acc = u @ W.T with u loaded as it is; in its
  epilogue each row's sum of squares from the partials (a fixed order: deterministic) gives
  rstd, y = acc * rstd (+ bias).

rms_norm(h) @ W.T = rstd * ((h * g) @ W.T) per row. The rounding differs from the two-step path's
(normed = (h * rstd rounded) * g rounded): here h * g is rounded once. In fp16 h * g, not yet
normalized, could overflow, so the engine uses these in bf16 only (linear_ops.uses_norm_epilogue).
Under tensor parallelism o_proj and down are row-parallel: each rank's y is a partial sum until
the all-reduce, so `add_prenorm`'s epilogue (residual add, statistics) belongs after it there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedinfer.kernels.gemv import GemvConfig, dot_grid, dot_rows, padded_rows, program_tile
from pagedinfer.kernels.linear_shapes import NORM_EPILOGUE_MAX_ROWS as MAX_ROWS
from pagedinfer.kernels.linear_shapes import Prenormed  # what add_prenorm returns


@triton.jit
def _add_prenorm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    residual_ptr,  # [M, N]
    norm_w_ptr,  # [N] the next norm's weight
    h_ptr,  # [M, N] out: x @ W.T + residual
    u_ptr,  # [M, N] out: h * norm_w
    partials_ptr,  # [column tiles, PARTIALS_ROWS] out: sum of h^2 over this program's columns
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_rm,
    PARTIALS_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm, rn, col_tile = program_tile(M, BLOCK_M, BLOCK_N)  # as gemv's dot kernel
    dtype = h_ptr.dtype.element_ty
    m_mask = rm < M
    n_mask = rn < N
    mn_mask = m_mask[:, None] & n_mask[None, :]
    # The epilogue's small loads go out before the weight stream, their latency hidden behind it
    # (chains 1-2% faster than loading after the loop: bench/NOTES.md, session 21).
    r = tl.load(residual_ptr + rm[:, None] * stride_rm + rn[None, :], mask=mn_mask, other=0.0)
    g = tl.load(norm_w_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    acc = dot_rows(x_ptr, w_ptr, rm, rn, K, stride_xm, stride_wn, M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    # The two-step path's rounding: the GEMV's output in the dtype, then x + residual rounded.
    h = (acc.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype)
    out = rm[:, None] * N + rn[None, :]
    tl.store(h_ptr + out, h, mask=mn_mask)
    hf = h.to(tl.float32)  # masked rows and columns are 0
    tl.store(u_ptr + out, (hf * g[None, :]).to(dtype), mask=mn_mask)
    tl.store(partials_ptr + col_tile * PARTIALS_ROWS + rm, tl.sum(hf * hf, axis=1))


@triton.jit
def _rstd_linear_kernel(
    u_ptr,  # [M, K] h * g
    w_ptr,  # [N, K]
    partials_ptr,  # [P, PARTIALS_ROWS] sums of h^2
    b_ptr,  # [N] or a dummy
    y_ptr,  # [M, N]
    M,
    N,
    K,
    P,
    stride_um,
    stride_wn,
    eps,
    HAS_BIAS: tl.constexpr,
    PARTIALS_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    rm, rn, _ = program_tile(M, BLOCK_M, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    rp = tl.arange(0, BLOCK_P)
    parts = tl.load(  # before the weight stream, as in _add_prenorm_kernel
        partials_ptr + rp[:, None] * PARTIALS_ROWS + rm[None, :],
        mask=(rp < P)[:, None] & m_mask[None, :],  # (rows past M: maybe never written)
        other=0.0,
    )
    acc = dot_rows(u_ptr, w_ptr, rm, rn, K, stride_um, stride_wn, M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(parts, axis=0) / K + eps))  # as the norm kernel
    acc *= rstd[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rm[:, None] * N + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def _check(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig) -> None:
    rows, k = x.shape
    if not (0 < rows <= MAX_ROWS and config.variant == "dot" and weight.shape[1] == k):
        raise ValueError(
            f"norm epilogue GEMVs take 1-{MAX_ROWS} rows, a dot config and weight [N, {k}], got "
            f"{tuple(x.shape)}, {config.variant}, {tuple(weight.shape)}"
        )


def add_prenorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    config: GemvConfig,
) -> Prenormed:
    """x [M, K] @ weight [N, K].T + residual [M, N] -> Prenormed for a norm of weight norm_weight [N]."""
    _check(x, weight, config)
    rows, k = x.shape
    n = weight.shape[0]
    grid, block_m = dot_grid(config, rows, n)
    h = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    u = torch.empty_like(h)
    # [column tiles, R]: R fixed by the rows alone (not by the row block), so the two kernels of a
    # pair may take different row blocks
    partials = torch.empty(
        (triton.cdiv(n, config.block_n), padded_rows(rows)), dtype=torch.float32, device=x.device
    )
    _add_prenorm_kernel[grid](
        x,
        weight,
        residual,
        norm_weight,
        h,
        u,
        partials,
        rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        residual.stride(0),
        PARTIALS_ROWS=partials.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return Prenormed(h, u, partials)


def rstd_linear(
    pre: Prenormed,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig,
) -> torch.Tensor:
    """rms_norm(pre.h) (its weight already in pre.u) @ weight [N, K].T (+ bias) -> [M, N]."""
    u = pre.u
    _check(u, weight, config)
    rows, k = u.shape
    n = weight.shape[0]
    y = torch.empty((rows, n), dtype=u.dtype, device=u.device)
    num_partials = pre.partials.shape[0]
    if pre.partials.shape[1] != padded_rows(rows):
        raise ValueError(f"partials {tuple(pre.partials.shape)} are not those of {rows} rows")
    grid, block_m = dot_grid(config, rows, n)
    _rstd_linear_kernel[grid](
        u,
        weight,
        pre.partials,
        bias if bias is not None else y,
        y,
        rows,
        n,
        k,
        num_partials,
        u.stride(0),
        weight.stride(0),
        float(eps),
        HAS_BIAS=bias is not None,
        PARTIALS_ROWS=pre.partials.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        BLOCK_P=triton.next_power_of_2(num_partials),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return y
