"""Triton kernel: RMSNorm, optionally fused with the residual add before it (one pass per row).

One program per row: load x (and the residual), write h = x + residual rounded to x's dtype
(the next residual), then weight * (h_f32 * rsqrt(mean(h_f32^2) + eps)).to(dtype), the same
rounding steps as fused_reference.rms_norm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, N]
    residual_ptr,  # [T, N] (unused without HAS_RESIDUAL)
    weight_ptr,  # [N]
    out_ptr,  # [T, N]
    residual_out_ptr,  # [T, N] (unused without HAS_RESIDUAL)
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # torch's x + residual rounds to the activation dtype; the norm reads the rounded sum.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n_cols
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(var + eps))
    normed = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps, out, residual_out) -> None:
    num_rows, n_cols = x.shape
    block = triton.next_power_of_2(n_cols)
    has_residual = residual is not None
    _rms_norm_kernel[(num_rows,)](
        x,
        residual if has_residual else x,
        weight,
        out,
        residual_out if has_residual else out,
        x.stride(0),
        residual.stride(0) if has_residual else 0,
        out.stride(0),
        residual_out.stride(0) if has_residual else 0,
        n_cols,
        float(eps),
        HAS_RESIDUAL=has_residual,
        BLOCK=block,
        num_warps=min(16, max(1, block // 512)),
        enable_fp_fusion=False,  # round each product like the torch ops do
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """x [T, N] (rows may be strided, columns contiguous), weight [N] -> [T, N] in out_dtype."""
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    _launch(x, None, weight, eps, out, None)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, residual) [T, N] -> (normed [T, N] in out_dtype, x + residual [T, N] in x's dtype)."""
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, residual, weight, eps, out, residual_out)
    return out, residual_out
