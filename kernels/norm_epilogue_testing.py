"""Test cases of the norm carried by GEMV epilogues (kernels/norm_epilogue.py), shared by the CPU
interpreter test and the GPU test: `add_prenorm` (an o_proj or down with the residual) then
`rstd_linear` (the qkv or gate_up after the norm), against the two-step path they replace: the
GEMV, x + residual in the dtype, fused_reference.rms_norm, an fp64 F.linear. Rows at their own
scales (a row normalized with another row's statistics is far off), odd widths (masked edge
tiles), several programs' partials, with and without bias.

Checked: the next residual h (to the GEMV's tolerance: only the order of its sums differs; in
fp16 / bf16 also equal bit for bit in >= 95% of its elements, which only holds when the GEMV's
output is rounded to the dtype before the residual add, as torch's two steps do), u = h * g bit
for bit from the kernel's own h, the partials summing to each row's sum of h^2, and the output's
worst row against the reference. One case reads the residual through a row stride wider than
its row.

`python -m pagedinfer.kernels.norm_epilogue_testing OUT.json` runs INTERPRETER_CASES on the CPU
(set TRITON_INTERPRET=1 in its environment) and writes one result per case and dtype.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedinfer.kernels import fused_reference
from pagedinfer.kernels.gemv import GemvConfig, row_block
from pagedinfer.kernels.gemv_testing import TOLERANCE, write_interpreter_results
from pagedinfer.kernels.norm_epilogue import add_prenorm, rstd_linear


@dataclass(frozen=True)
class EpilogueCase:
    name: str
    config: GemvConfig
    rows: int
    k_in: int  # the first GEMV's input width (heads or intermediate)
    hidden: int  # its output width: the normed row
    n_out: int  # the second GEMV's output width
    bias: bool = False
    residual_pad: int = 0  # the residual a view of wider rows (its row stride hidden + pad)
    second_config: GemvConfig | None = None  # rstd_linear's, when not `config`


_DOT = GemvConfig("dot", 16, 32, 4, 2)
_DOT_ROW_BLOCKS = GemvConfig("dot", 16, 32, 4, 2, block_m=16)
INTERPRETER_CASES = [
    EpilogueCase("rows5_edges_bias", _DOT, 5, 75, 72, 37, bias=True),  # 5 programs of partials
    EpilogueCase("rows2_strided_residual", _DOT, 2, 64, 48, 40, residual_pad=9),
    EpilogueCase("rows16_wide_tiles", GemvConfig("dot", 32, 64, 4, 2), 16, 130, 96, 40),
    # past 16 rows (a batch-8 verification of a small model): 32- and 64-row tiles, a full tile
    EpilogueCase("rows24_32row_tile", _DOT, 24, 64, 48, 40),
    EpilogueCase("rows40_64row_tile", _DOT, 40, 75, 72, 37, bias=True),
    EpilogueCase("rows64_full_tile", GemvConfig("dot", 32, 64, 4, 2), 64, 40, 40, 24, residual_pad=3),
    # rows split over row blocks (gemv.row_block): the same blocks on both sides, then a pair
    # whose two kernels take different blocks (the partials' layout is the rows', not the block's)
    EpilogueCase("rows40_16row_blocks", _DOT_ROW_BLOCKS, 40, 75, 72, 37, bias=True),
    EpilogueCase("rows56_blocks_then_one_tile", _DOT_ROW_BLOCKS, 56, 40, 48, 24, second_config=_DOT),
    EpilogueCase("rows24_one_tile_then_blocks", _DOT, 24, 64, 48, 40, second_config=_DOT_ROW_BLOCKS),
    # 16-row blocks write rows 0-47 of 64: the one-tile rstd_linear must not read 48-63 into a row
    EpilogueCase(
        "rows40_blocks_then_one_tile", _DOT_ROW_BLOCKS, 40, 40, 48, 24, bias=True, second_config=_DOT
    ),
]
INTERPRETER_DTYPES = (torch.float32, torch.float16)


def make_inputs(case: EpilogueCase, dtype: torch.dtype, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(case.rows, case.k_in, generator=gen)
    w1 = torch.randn(case.hidden, case.k_in, generator=gen) / case.k_in**0.5
    row_scale = 3.0 * (1.0 + torch.arange(case.rows, dtype=torch.float32))[:, None]
    residual = row_scale * torch.randn(case.rows, case.hidden + case.residual_pad, generator=gen)
    g = 1.0 + 0.5 * torch.randn(case.hidden, generator=gen)
    w2 = torch.randn(case.n_out, case.hidden, generator=gen) / case.hidden**0.5
    b = torch.randn(case.n_out, generator=gen) if case.bias else None
    x, w1, residual, g, w2, b = (
        t.to(device, dtype) if t is not None else None for t in (x, w1, residual, g, w2, b)
    )
    return x, w1, residual[:, : case.hidden], g, w2, b


def reference(x, w1, residual, g, w2, b, eps):
    """The two-step path: (h, fp64 output of the normed h's GEMV). The first GEMV's output is
    rounded once from fp64 (a GEMM library may reduce in the dtype: not the thing compared)."""
    y1 = F.linear(x.double(), w1.double()).to(x.dtype)
    h = (y1.float() + residual.float()).to(x.dtype)
    normed = fused_reference.rms_norm(h, g, eps)
    y = F.linear(normed.double(), w2.double(), b.double() if b is not None else None)
    return h, y


def worst_row_rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((a.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)).max())


def check(pre, y, g, ref_h, ref_y, dtype: torch.dtype, written_rows: int | None = None) -> dict:
    """written_rows: the partials' rows add_prenorm wrote (its row blocks'; all when None)."""
    rows = ref_h.shape[0]
    h_rel = worst_row_rel(pre.h, ref_h)
    h_equal = float((pre.h == ref_h).float().mean())  # fp32 sums in another order move fp32's last bits
    h_equal_needed = 0.0 if dtype == torch.float32 else 0.95
    u_exact = bool(torch.equal(pre.u, (pre.h.float() * g.float()).to(dtype)))
    squares = pre.h.double().pow(2).sum(-1)
    partial_rel = float(((pre.partials[:, :rows].double().sum(0) - squares).abs() / squares).max())
    pad_rows_zero = bool((pre.partials[:, rows:written_rows] == 0).all())  # masked rows add nothing
    y_rel = worst_row_rel(y, ref_y)
    tol = TOLERANCE[dtype]
    return {
        "h_rel": h_rel,
        "h_equal": h_equal,
        "u_exact": u_exact,
        "partial_rel": partial_rel,
        "pad_rows_zero": pad_rows_zero,
        "y_rel": y_rel,
        "ok": h_rel <= tol
        and h_equal >= h_equal_needed
        and u_exact
        and partial_rel <= 1e-5
        and pad_rows_zero
        and y_rel <= tol,
    }


def run_case(case: EpilogueCase, dtype: torch.dtype, device: str, seed: int = 0, eps: float = 1e-5) -> dict:
    x, w1, residual, g, w2, b = make_inputs(case, dtype, device, seed)
    pre, written_rows = prenorm_with_poisoned_pad(x, w1, residual, g, case.config)
    y = rstd_linear(pre, eps, w2, b, case.second_config or case.config)
    ref_h, ref_y = reference(x, w1, residual, g, w2, b, eps)
    return {
        "name": case.name,
        "dtype": str(dtype).removeprefix("torch."),
        **check(pre, y, g, ref_h, ref_y, dtype, written_rows),
    }


def prenorm_with_poisoned_pad(x, w1, residual, g, config: GemvConfig):
    """add_prenorm, then its partials past the written rows set to NaN (what torch.empty may hold
    there): a second kernel that let such a row into a stored output fails the check. Returns
    (Prenormed, rows written)."""
    pre = add_prenorm(x, w1, residual, g, config)
    block = row_block(config, x.shape[0])
    written_rows = -(-x.shape[0] // block) * block
    pre.partials[:, written_rows:] = float("nan")
    return pre, written_rows


if __name__ == "__main__":
    write_interpreter_results(sys.argv[1], run_case, INTERPRETER_CASES, INTERPRETER_DTYPES)
