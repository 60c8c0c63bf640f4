"""Test cases of the fused elementwise kernels, shared by the CPU interpreter test and the GPU test.

A case runs a backend (normally "triton") and the reference (fused_reference.py: the pre-fusion
layer code, in the same dtype) on the same random inputs and compares every output:
  err_ulp    max |out - ref| / (|ref| + 1e-3 max|ref|) / eps(dtype): rounding flips allowed
  mismatch   fraction of elements that differ at all (fp16/bf16 only: a few boundary flips)
Cache contents must match bit for bit (slots written with rounded values, others untouched).

`python -m pagedinfer.kernels.fused_testing OUT.json` runs INTERPRETER_CASES on the CPU (set
TRITON_INTERPRET=1 in its environment) and writes one result per case and dtype.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass

import torch

from pagedinfer.kernels import fused_ops, fused_reference

MAX_ERR_ULP = 4.0  # exp/rsqrt approximations and FMA contraction flip the last rounding at most
MAX_MISMATCH = 0.02  # half dtypes: share of elements allowed to differ by such a flip


@dataclass(frozen=True)
class FusedCase:
    """kind: 'norm', 'add_norm', 'rotary' or 'silu'. rows = T; width = hidden / intermediate."""

    name: str
    kind: str
    rows: int
    width: int = 0
    row_pad: int = 0  # extra columns between rows: strided (non-contiguous) row inputs
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    max_position: int = 4096
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class FusedResult:
    name: str
    dtype: str
    err_ulp: float
    mismatch: float
    caches_equal: bool

    @property
    def ok(self) -> bool:
        return (
            math.isfinite(self.err_ulp)
            and self.err_ulp <= MAX_ERR_ULP
            and self.mismatch <= (1.0 if self.dtype == "float32" else MAX_MISMATCH)
            and self.caches_equal
        )


def _randn(shape, dtype, device, gen, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype=dtype, device=device)


def _rows(case: FusedCase, dtype, device, gen, scale: float = 1.0) -> torch.Tensor:
    """[rows, width] with row stride width + row_pad (a column slice of a wider tensor)."""
    full = _randn((case.rows, case.width + case.row_pad), dtype, device, gen, scale)
    return full[:, : case.width]


def _compare(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> tuple[float, float]:
    if out.shape != ref.shape or out.dtype != ref.dtype:
        raise AssertionError(f"got {out.dtype} {tuple(out.shape)}, want {ref.dtype} {tuple(ref.shape)}")
    if not bool(torch.isfinite(out).all()):
        return float("nan"), 1.0
    o, r = out.double(), ref.double()
    floor = 1e-3 * float(r.abs().max()) if r.numel() else 0.0
    rel = (o - r).abs() / (r.abs() + max(floor, 1e-30))
    err = float(rel.max()) / torch.finfo(dtype).eps if r.numel() else 0.0
    return err, float((out != ref).float().mean()) if r.numel() else 0.0


def _run_norm(case, dtype, device, backend, gen) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x = _rows(case, dtype, device, gen)
    weight = (torch.rand(case.width, generator=gen) + 0.5).to(dtype=dtype, device=device)
    eps = 1e-5
    if case.kind == "norm":
        return [(fused_ops.rms_norm(x, weight, eps, backend), fused_reference.rms_norm(x, weight, eps))]
    residual = _rows(case, dtype, device, gen, scale=4.0)
    out = fused_ops.add_rms_norm(x, residual, weight, eps, backend)
    ref = fused_reference.add_rms_norm(x, residual, weight, eps)
    return list(zip(out, ref, strict=True))


def _run_rotary(case, dtype, device, backend, gen) -> tuple[list, bool]:
    heads = case.num_heads + 2 * case.num_kv_heads
    width = heads * case.head_dim
    qkv = _randn((case.rows, width + case.row_pad), dtype, device, gen)[:, :width]
    positions = torch.randint(0, case.max_position, (case.rows,), generator=gen).to(device)
    exponents = torch.arange(0, case.head_dim, 2).float() / case.head_dim  # [D/2]
    inv_freq = (1.0 / case.rope_theta**exponents).to(device)
    cos, sin = fused_reference.rope_cos_sin(positions, inv_freq)
    num_blocks = case.rows // case.block_size + 3
    slots = torch.randperm(num_blocks * case.block_size, generator=gen)[: case.rows].to(device)
    cache_shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    caches = [_randn(cache_shape, dtype, device, gen) for _ in range(2)]
    expect = [c.clone() for c in caches]
    q = fused_ops.rotary_cache_write(qkv, cos, sin, *caches, slots, backend)
    q_ref = fused_reference.rotary_cache_write(qkv, cos, sin, *expect, slots)
    pairs = [(q, q_ref), *zip(caches, expect, strict=True)]
    caches_equal = all(torch.equal(c, e) for c, e in zip(caches, expect, strict=True))
    return pairs, caches_equal


def run_case(
    case: FusedCase, dtype: torch.dtype, device, backend: str = "triton", seed: int = 0
) -> FusedResult:
    """Run one case on `backend` and compare with the reference on the same inputs."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    caches_equal = True
    if case.kind in ("norm", "add_norm"):
        pairs = _run_norm(case, dtype, device, backend, gen)
    elif case.kind == "rotary":
        pairs, caches_equal = _run_rotary(case, dtype, device, backend, gen)
    elif case.kind == "silu":
        gate_up = _rows(case, dtype, device, gen, scale=3.0)
        pairs = [(fused_ops.silu_mul(gate_up, backend), fused_reference.silu_mul(gate_up))]
    else:
        raise ValueError(f"unknown case kind {case.kind!r}")
    errs = [_compare(out, ref, dtype) for out, ref in pairs]
    return FusedResult(
        case.name,
        str(dtype).removeprefix("torch."),
        max(e for e, _ in errs),
        max(m for _, m in errs),
        caches_equal,
    )


_C = FusedCase
# Small shapes for the CPU interpreter: non-power-of-two widths (SmolLM2 576, 96), strided rows,
# head counts that do not fill the 8-head programs (9/3: 15 heads), head dims 64, 80, 128.
INTERPRETER_CASES = (
    _C("norm_576", "norm", 3, 576),
    _C("norm_strided", "norm", 4, 96, row_pad=32),
    _C("add_norm_576", "add_norm", 5, 576),
    _C("add_norm_strided", "add_norm", 2, 1000, row_pad=8),
    _C("rotary_smollm_9_3", "rotary", 7, num_heads=9, num_kv_heads=3),
    _C("rotary_d80_bs8", "rotary", 5, num_heads=4, num_kv_heads=4, head_dim=80, block_size=8, row_pad=16),
    _C("rotary_d128_long_pos", "rotary", 3, num_heads=8, num_kv_heads=1, head_dim=128, max_position=131072, rope_theta=500000.0),
    _C("silu_1500", "silu", 3, 2 * 1500),
    _C("silu_strided", "silu", 2, 2 * 64, row_pad=10),
)  # fmt: skip
INTERPRETER_DTYPES = (torch.float32, torch.float16)


def main(argv: list[str]) -> int:
    results = [
        {**asdict(r), "ok": r.ok}
        for i, case in enumerate(INTERPRETER_CASES)
        for dtype in INTERPRETER_DTYPES
        for r in [run_case(case, dtype, "cpu", backend="triton", seed=i)]
    ]
    with open(argv[0], "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
