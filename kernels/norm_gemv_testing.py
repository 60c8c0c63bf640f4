"""Test cases of the norm-folded GEMV (kernels/norm_gemv.py), shared by the CPU interpreter test
and the GPU test: random (not zero) data with a non-trivial norm weight and residual, odd K
(masked edge tiles of both the statistics and the GEMV), with and without residual and bias.

The reference is the two-step path the kernel replaces: fused_reference.add_rms_norm (or
rms_norm) in the dtype, then an fp64 F.linear of its output. The next residual h must equal
x + residual bit for bit (it is the model's running sum).

`python -m pagedinfer.kernels.norm_gemv_testing OUT.json` runs INTERPRETER_CASES on the CPU (set
TRITON_INTERPRET=1 in its environment) and writes one result per case and dtype.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedinfer.kernels import fused_reference
from pagedinfer.kernels.gemv import GemvConfig
from pagedinfer.kernels.gemv_testing import TOLERANCE, write_interpreter_results
from pagedinfer.kernels.norm_gemv import add_norm_gemv


@dataclass(frozen=True)
class NormGemvCase:
    name: str
    config: GemvConfig
    n: int
    k: int
    residual: bool = True
    bias: bool = False


INTERPRETER_CASES = [
    NormGemvCase("residual", GemvConfig("reduce", 16, 32, 4, 2), 40, 96),
    NormGemvCase("residual_edges_bias", GemvConfig("reduce", 16, 32, 4, 2), 37, 75, bias=True),
    NormGemvCase("first_layer", GemvConfig("reduce", 8, 64, 4, 2), 24, 130, residual=False),
]
INTERPRETER_DTYPES = (torch.float32, torch.float16)


def make_inputs(case: NormGemvCase, dtype: torch.dtype, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = 3.0 * torch.randn(1, case.k, generator=gen)  # far from unit RMS: the norm must act
    residual = torch.randn(1, case.k, generator=gen) if case.residual else None
    norm_weight = 1.0 + 0.5 * torch.randn(case.k, generator=gen)
    w = torch.randn(case.n, case.k, generator=gen) / case.k**0.5
    b = torch.randn(case.n, generator=gen) if case.bias else None
    return tuple(t.to(device, dtype) if t is not None else None for t in (x, residual, norm_weight, w, b))


def reference(x, residual, norm_weight, eps, w, b) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused path: (fp64 linear of the normed row, the next residual)."""
    if residual is None:
        normed, hidden = fused_reference.rms_norm(x, norm_weight, eps), x
    else:
        normed, hidden = fused_reference.add_rms_norm(x, residual, norm_weight, eps)
    y = F.linear(normed.double(), w.double(), b.double() if b is not None else None)
    return y, hidden


def check(y, hidden, ref_y, ref_hidden, n: int, dtype: torch.dtype) -> dict:
    rel = float((y.double() - ref_y).norm() / ref_y.norm())
    shape_ok = tuple(y.shape) == (1, n) and y.dtype == dtype
    residual_exact = bool(torch.equal(hidden, ref_hidden))
    return {
        "rel_err": rel,
        "shape_ok": shape_ok,
        "residual_exact": residual_exact,
        "ok": rel <= TOLERANCE[dtype] and shape_ok and residual_exact,
    }


def run_case(case: NormGemvCase, dtype: torch.dtype, device: str, seed: int = 0, eps: float = 1e-5) -> dict:
    x, residual, norm_weight, w, b = make_inputs(case, dtype, device, seed)
    y, hidden = add_norm_gemv(x, residual, norm_weight, eps, w, b, case.config)
    ref_y, ref_hidden = reference(x, residual, norm_weight, eps, w, b)
    return {
        "name": case.name,
        "dtype": str(dtype).removeprefix("torch."),
        **check(y, hidden, ref_y, ref_hidden, case.n, dtype),
    }


if __name__ == "__main__":
    write_interpreter_results(sys.argv[1], run_case, INTERPRETER_CASES, INTERPRETER_DTYPES)
