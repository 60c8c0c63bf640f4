"""Launcher of the model's linear layers: the small-batch GEMV kernel where it applies, else torch.

A decode step of a few tokens reads every weight once for a few multiply-adds per byte; there
`kernels/gemv.py` streams the weights closer to the copy bandwidth than torch's GEMM (measured in
bench/gemv.py). Everything else (prefill, large batches, the CPU, fp32/fp64) is `F.linear`.
Checks look at shapes and dtypes only, so a launch inside CUDA-graph capture never synchronizes.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from pagedinfer.kernels.ops import select_backend

GEMV_DTYPES = (torch.float16, torch.bfloat16)
# PAGEDINFER_GEMV=0 keeps torch's GEMM for every shape (an escape hatch, and the A/B switch of
# the benchmarks); PAGEDINFER_GEMV_MAX_ROWS moves the row count up to which the kernel is used.
GEMV_ENABLED = os.environ.get("PAGEDINFER_GEMV", "1") != "0"
GEMV_MAX_ROWS = min(int(os.environ.get("PAGEDINFER_GEMV_MAX_ROWS", "16")), 16)  # 16: gemv.MAX_ROWS


def uses_gemv(x: torch.Tensor, weight: torch.Tensor, backend: str | None = None) -> bool:
    return (
        GEMV_ENABLED
        and x.dim() == 2
        and 0 < x.shape[0] <= GEMV_MAX_ROWS
        and x.dtype in GEMV_DTYPES
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.stride(1) == 1
        and x.stride(1) == 1
        and select_backend(x.device, backend) == "triton"
    )


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, backend: str | None = None
) -> torch.Tensor:
    """x [T, K] @ weight [N, K].T (+ bias) -> [T, N] in x's dtype."""
    if not uses_gemv(x, weight, backend):
        return F.linear(x, weight, bias)
    from pagedinfer.kernels import gemv

    return gemv.gemv(x, weight, bias, gemv.config_for(x.shape[0], weight.shape[0], weight.shape[1]))
