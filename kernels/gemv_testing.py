"""Test cases of the small-batch linear kernels (kernels/gemv.py), shared by the CPU interpreter
test and the GPU test: every variant on random (not zero) data, odd N and K (masked edge tiles),
with and without bias, against an fp64 `F.linear` of the same inputs.

`python -m pagedinfer.kernels.gemv_testing OUT.json` runs INTERPRETER_CASES on the CPU (set
TRITON_INTERPRET=1 in its environment) and writes one result per case and dtype.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedinfer.kernels.gemv import GemvConfig, gemv

# Relative error of the output (norm) allowed per dtype: the one rounding of the result, and a
# different summation order than the reference's.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@dataclass(frozen=True)
class GemvCase:
    name: str
    config: GemvConfig
    rows: int
    n: int
    k: int
    bias: bool = False
    row_pad: int = 0  # extra columns between rows of x and of the weight (strided rows)


INTERPRETER_CASES = [
    GemvCase("reduce_1row", GemvConfig("reduce", 16, 32, 4, 2), 1, 40, 96),
    GemvCase("reduce_edges_bias", GemvConfig("reduce", 16, 32, 4, 2), 2, 37, 75, bias=True),
    GemvCase("reduce_strided", GemvConfig("reduce", 8, 64, 4, 2), 1, 24, 130, row_pad=6),
    GemvCase("dot_1row", GemvConfig("dot", 16, 32, 4, 2), 1, 48, 64),
    GemvCase("dot_edges_bias", GemvConfig("dot", 32, 32, 4, 2), 5, 45, 70, bias=True),
    GemvCase("dot_16rows", GemvConfig("dot", 16, 64, 4, 2), 16, 32, 128, row_pad=2),
    # The engine's wide-N and long-K tiles (gemv.config_for at 2-16 rows), masked edges on both.
    GemvCase("dot_wide_tile", GemvConfig("dot", 64, 256, 4, 3), 3, 70, 300),
    GemvCase("dot_long_k_tile", GemvConfig("dot", 32, 512, 4, 3), 4, 40, 600),
    GemvCase("dot_small_model_tile", GemvConfig("dot", 16, 256, 2, 4), 5, 37, 300, bias=True),
    # 17-64 rows (a verification batch: B x (K + 1)): 32- and 64-row tiles
    GemvCase("dot_24rows", GemvConfig("dot", 32, 64, 4, 2), 24, 50, 130, bias=True),
    GemvCase("dot_64rows", GemvConfig("dot", 16, 64, 4, 2), 64, 33, 96, row_pad=3),
    # rows split over row blocks (block_m): a partial last block, full blocks, one block
    GemvCase("dot_40rows_16row_blocks", GemvConfig("dot", 16, 64, 4, 2, block_m=16), 40, 37, 96, bias=True),
    GemvCase("dot_64rows_32row_blocks", GemvConfig("dot", 32, 32, 4, 2, block_m=32), 64, 40, 70, row_pad=3),
    GemvCase("dot_5rows_one_row_block", GemvConfig("dot", 16, 64, 4, 2, block_m=16), 5, 24, 64),
]
INTERPRETER_DTYPES = (torch.float32, torch.float16)


def run_case(case: GemvCase, dtype: torch.dtype, device: str, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(case.rows, case.k + case.row_pad, generator=gen)
    w = torch.randn(case.n, case.k + case.row_pad, generator=gen) / case.k**0.5
    b = torch.randn(case.n, generator=gen) if case.bias else None
    # Sliced after the conversion, which would copy a strided view into a contiguous tensor.
    x, w = x.to(device, dtype)[:, : case.k], w.to(device, dtype)[:, : case.k]
    b = b.to(device, dtype) if b is not None else None
    out = gemv(x, w, b, case.config)
    ref = F.linear(x.double(), w.double(), b.double() if b is not None else None)
    rel = float((out.double() - ref).norm() / ref.norm())
    shape_ok = tuple(out.shape) == (case.rows, case.n) and out.dtype == dtype
    return {
        "name": case.name,
        "dtype": str(dtype).removeprefix("torch."),
        "rel_err": rel,
        "shape_ok": shape_ok,
        "ok": rel <= TOLERANCE[dtype] and shape_ok,
    }


def write_interpreter_results(path: str, run_case, cases, dtypes) -> None:
    """Runs every case in every dtype on the CPU (seed = the case's index) and writes one JSON
    result each to `path`: the `__main__` of the kernels' *_testing modules."""
    results = [run_case(case, dtype, "cpu", seed=i) for i, case in enumerate(cases) for dtype in dtypes]
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    write_interpreter_results(sys.argv[1], run_case, INTERPRETER_CASES, INTERPRETER_DTYPES)
