"""Launcher of the model's linear layers: the small-batch GEMV kernel where it applies, else torch.

A decode step of a few tokens reads every weight once for a few multiply-adds per byte; there
`kernels/gemv.py` streams the weights closer to the copy bandwidth than torch's GEMM (measured in
bench/gemv.py). Everything else (prefill, large batches, the CPU, fp32/fp64) is `F.linear`.
`norm_linear` is the same with the RMSNorm before it (and its residual add) folded into one kernel
at one row (kernels/norm_gemv.py), the fused norm and `linear` otherwise. At 2-16 rows in bf16 (up to
64 for a small model) `linear_residual` (o_proj, down) computes the next norm's statistics in its epilogue and
`norm_linear` applies them in its GEMV's epilogue (kernels/norm_epilogue.py): no norm kernel.
Checks look at shapes and dtypes only, so a launch inside CUDA-graph capture never synchronizes.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch
import torch.nn.functional as F

from pagedinfer.kernels import fused_ops
from pagedinfer.kernels.linear_shapes import NORM_EPILOGUE_MAX_ROWS, SMALL_MODEL_MAX_K, Prenormed
from pagedinfer.kernels.ops import build_errors, select_backend

logger = logging.getLogger(__name__)

GEMV_DTYPES = (torch.float16, torch.bfloat16)
# PAGEDINFER_GEMV=0 keeps torch's GEMM for every shape (an escape hatch, and the A/B switch of
# the benchmarks); PAGEDINFER_GEMV_MAX_ROWS moves the row count up to which the kernel may be used
# (past 16 rows only for the shapes gemv.config_for names; 16 restores torch there for all).
GEMV_ENABLED = os.environ.get("PAGEDINFER_GEMV", "1") != "0"
GEMV_MAX_ROWS = min(int(os.environ.get("PAGEDINFER_GEMV_MAX_ROWS", "64")), 64)  # 64: gemv.MAX_ROWS
# PAGEDINFER_NORM_GEMV=0 keeps the RMSNorm a kernel of its own before a one-row GEMV (A/B switch).
NORM_GEMV_ENABLED = os.environ.get("PAGEDINFER_NORM_GEMV", "1") != "0"
# PAGEDINFER_NORM_EPILOGUE=0 keeps the norm kernel at 2-64 rows (the A/B switch of the benchmarks).
NORM_EPILOGUE_ENABLED = os.environ.get("PAGEDINFER_NORM_EPILOGUE", "1") != "0"
# fp16 would overflow on h * g before the norm scales it (kernels/norm_epilogue.py).
NORM_EPILOGUE_DTYPES = (torch.bfloat16,)
# Past 16 rows only where the block's output width (the next GEMV's K) is a small model's
# (hidden size <= SMALL_MODEL_MAX_K): gemv.config_for gives every such K a dot config at 2-64
# rows, so the next norm_linear finishes the norm in its kernel (at 17-64 rows larger models'
# qkv and gate_up may run torch's GEMM, which cannot).
NORM_EPILOGUE_WIDE_MAX_ROWS = 16


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


# GEMV configs this device cannot run: the tiles were sized on an H200 (up to ~150 KB of shared
# memory); a GPU with less raises OutOfResources when the kernel loads (or another Triton or
# ptxas build error), and the layer falls back.
_UNFIT_CONFIGS: set = set()


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, backend: str | None = None
) -> torch.Tensor:
    """x [T, K] @ weight [N, K].T (+ bias) -> [T, N] in x's dtype."""
    if not uses_gemv(x, weight, backend):
        return F.linear(x, weight, bias)
    from pagedinfer.kernels import gemv

    config = gemv.config_for(x.shape[0], weight.shape[0], weight.shape[1])
    if config is None:
        return F.linear(x, weight, bias)
    # A tile that does not fit this GPU: the variant's small default tile (on the same row
    # blocks: a 64-row tile would need more shared memory, not less), then torch's GEMM.
    fallback = (
        replace(gemv.DOT_CONFIG, block_m=config.block_m) if config.variant == "dot" else gemv.DEFAULT_CONFIG
    )
    for candidate in dict.fromkeys((config, fallback)):
        y = _launch_if_fits(candidate, lambda c=candidate: gemv.gemv(x, weight, bias, c))
        if y is not None:
            return y
    return F.linear(x, weight, bias)


def _launch_if_fits(key, launch):
    """launch() unless `key` (a kernel config) is known not to build for this GPU; None when it
    does not: Triton raises OutOfResources as the kernel loads (a tile sized for more shared
    memory), a CompilationError or PTXASError as it compiles, all before anything runs on the
    device (ops.build_errors, the attention launchers' rule)."""
    if key in _UNFIT_CONFIGS:
        return None
    try:
        return launch()
    except build_errors() as exc:
        _UNFIT_CONFIGS.add(key)
        logger.warning("GEMV config %s does not build for this GPU (%s): not used again", key, exc)
        return None


def uses_norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    backend=None,
    bias: torch.Tensor | None = None,
) -> bool:
    """The one-row GEMV with the RMSNorm folded in: one row, one dtype and device for every operand.

    Shapes that do not match take the two-step path, whose checks name the problem. Triton is
    imported only once the GEMV applies (a CPU-only install has none).
    """
    if not (
        NORM_GEMV_ENABLED
        and fused_ops.FUSED_KERNELS_ENABLED
        and x.dim() == 2
        and x.shape[0] == 1
        and uses_gemv(x, weight, backend)
    ):
        return False
    from pagedinfer.kernels.norm_gemv import MAX_ROW

    k = x.shape[1]
    return (
        k <= MAX_ROW
        and weight.shape[1] == k
        and (bias is None or (tuple(bias.shape) == (weight.shape[0],) and bias.device == x.device))
        and weight.device == x.device
        and norm_weight.device == x.device
        and tuple(norm_weight.shape) == (k,)
        and norm_weight.dtype == x.dtype
        and norm_weight.stride(0) == 1
        and (
            residual is None
            or (
                residual.shape == x.shape
                and residual.dtype == x.dtype
                and residual.device == x.device
                and residual.stride(-1) == 1
            )
        )
    )


def uses_norm_epilogue(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, backend=None
) -> bool:
    """x @ weight.T + residual with the next norm's statistics in the epilogue: 2-16 rows (up to
    64 for an output width of at most SMALL_MODEL_MAX_K) of a NORM_EPILOGUE_DTYPES dtype on the
    GEMV path, operands on one device in one dtype."""
    n = weight.shape[0]
    max_rows = NORM_EPILOGUE_MAX_ROWS if n <= SMALL_MODEL_MAX_K else NORM_EPILOGUE_WIDE_MAX_ROWS
    if not (
        NORM_EPILOGUE_ENABLED
        and fused_ops.FUSED_KERNELS_ENABLED
        and x.dim() == 2
        and 2 <= x.shape[0] <= max_rows
        and x.dtype in NORM_EPILOGUE_DTYPES
        and uses_gemv(x, weight, backend)
    ):
        return False
    return (
        weight.device == x.device
        and tuple(residual.shape) == (x.shape[0], n)
        and residual.dtype == x.dtype
        and residual.device == x.device
        and residual.stride(-1) == 1
        and tuple(norm_weight.shape) == (n,)
        and norm_weight.dtype == x.dtype
        and norm_weight.device == x.device
        and norm_weight.stride(0) == 1
    )


def linear_residual(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    next_norm_weight: torch.Tensor | None,
    backend: str | None = None,
) -> tuple[torch.Tensor | Prenormed, torch.Tensor | None]:
    """x [T, K] @ weight [N, K].T, the block output, with the residual stream [T, N] -> what the
    next `norm_linear` takes: (Prenormed, None) when the next norm (weight next_norm_weight) rides
    in this GEMV's epilogue (`uses_norm_epilogue`), else (y, residual) unchanged."""
    if next_norm_weight is not None and uses_norm_epilogue(x, weight, residual, next_norm_weight, backend):
        from pagedinfer.kernels import gemv, norm_epilogue

        config = gemv.config_for(x.shape[0], weight.shape[0], weight.shape[1])
        if config is not None and config.variant == "dot":
            pre = _launch_if_fits(
                ("prenorm", config),
                lambda: norm_epilogue.add_prenorm(x, weight, residual, next_norm_weight, config),
            )
            if pre is not None:
                return pre, None
    return linear(x, weight, None, backend), residual


def _prenormed_linear(
    pre: Prenormed, eps: float, weight: torch.Tensor, bias: torch.Tensor | None, backend: str | None
) -> torch.Tensor:
    """rms_norm(pre.h) @ weight.T (+ bias), the norm finished in the GEMV's epilogue; torch's
    ops where the kernel does not apply (the same math, unfused)."""
    rows, k = pre.u.shape
    if weight.shape[1] != k:
        raise ValueError(f"weight {tuple(weight.shape)} does not take rows of {k}")
    if uses_gemv(pre.u, weight, backend) and rows <= NORM_EPILOGUE_MAX_ROWS:
        from pagedinfer.kernels import gemv, norm_epilogue

        config = gemv.config_for(rows, weight.shape[0], k)
        if config is not None and config.variant == "dot":
            y = _launch_if_fits(
                ("rstd", config), lambda: norm_epilogue.rstd_linear(pre, eps, weight, bias, config)
            )
            if y is not None:
                return y
    rstd = torch.rsqrt(pre.partials[:, :rows].sum(0) / k + eps)
    return linear((pre.u.float() * rstd[:, None]).to(pre.u.dtype), weight, bias, backend)


def norm_linear(
    x: torch.Tensor | Prenormed,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, residual) [T, K] -> (rms_norm(h) @ weight.T (+ bias) [T, N], h [T, K]), h = x + residual.

    Without a residual h is x itself (a model's first layer). One kernel for a single row on the
    GPU (kernels/norm_gemv.py), else the fused norm (fused_ops) followed by `linear`. A Prenormed
    x (from `linear_residual`, residual None) carries h and this norm, weight applied, inside it.
    """
    if isinstance(x, Prenormed):
        return _prenormed_linear(x, eps, weight, bias, backend), x.h
    if uses_norm_gemv(x, residual, norm_weight, weight, backend, bias):
        from pagedinfer.kernels import gemv, norm_gemv

        config = gemv.config_for(1, weight.shape[0], weight.shape[1])
        out = _launch_if_fits(
            ("norm", config),
            lambda: norm_gemv.add_norm_gemv(x, residual, norm_weight, eps, weight, bias, config),
        )
        if out is not None:
            return out
    if residual is None:
        normed, hidden = fused_ops.rms_norm(x, norm_weight, eps, backend=backend), x
    else:
        normed, hidden = fused_ops.add_rms_norm(x, residual, norm_weight, eps, backend=backend)
    return linear(normed, weight, bias, backend), hidden
