"""Triton kernel: SwiGLU's silu(gate) * up from the fused gate_up GEMM output, in one pass.

Grid (rows, column tiles). The same rounding steps as fused_reference.silu_mul: silu in fp32,
rounded to the activation dtype (F.silu's output), then the product rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per program: 2 KiB of bf16 per operand


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [T, 2 I]: gate in columns [0, I), up in [I, 2 I)
    out_ptr,  # [T, I]
    stride_in,
    stride_out,
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    base = gate_up_ptr + row * stride_in
    gate = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = tl.math.div_rn(gate, 1.0 + tl.exp(-gate))
    silu = silu.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 I] (columns contiguous) -> silu(gate) * up [T, I] in gate_up's dtype."""
    num_rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    grid = (num_rows, triton.cdiv(inter, BLOCK))
    _silu_mul_kernel[grid](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        inter,
        BLOCK=BLOCK,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return out
