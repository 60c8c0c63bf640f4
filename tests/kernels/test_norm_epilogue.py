"""The RMSNorm carried by GEMV epilogues at 2-64 rows (kernels/norm_epilogue.py, linear_ops
linear_residual / norm_linear): the kernels under TRITON_INTERPRET=1 against the two-step path,
the checks' power to fail, the dispatch, the torch fallback, and (marked gpu) the engine's
configs at the SmolLM2, Qwen2 and 8B layer shapes in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedinfer.kernels import fused_ops, linear_ops
from pagedinfer.kernels.linear_ops import Prenormed
from pagedinfer.kernels.norm_epilogue_testing import (
    INTERPRETER_CASES,
    INTERPRETER_DTYPES,
    EpilogueCase,
    check,
    make_inputs,
    prenorm_with_poisoned_pad,
    reference,
)
from tests.kernels.interpreter_run import run_interpreter_cases

pytest.importorskip("triton")

CASE_IDS = [(c.name, str(d).removeprefix("torch.")) for c in INTERPRETER_CASES for d in INTERPRETER_DTYPES]
EPS = 1e-5


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory) -> dict[tuple[str, str], dict]:
    return run_interpreter_cases(
        "pagedinfer.kernels.norm_epilogue_testing", tmp_path_factory.mktemp("norm_epilogue")
    )


@pytest.mark.parametrize("name,dtype", CASE_IDS, ids=[f"{n}-{d}" for n, d in CASE_IDS])
def test_epilogue_norm_matches_the_two_step_path(interpreter_results, name, dtype):
    result = interpreter_results[(name, dtype)]
    assert result["ok"], result


def _torch_prenormed(x, w1, residual, g, programs: int, row_tile: int = 16) -> Prenormed:
    """What add_prenorm computes, in torch (partials split over `programs` column blocks)."""
    h = (F.linear(x, w1).float() + residual.float()).to(x.dtype)
    partials = torch.zeros(programs, row_tile)
    for p, cols in enumerate(h.float().chunk(programs, dim=1)):
        partials[p, : h.shape[0]] = cols.pow(2).sum(-1)
    return Prenormed(h, (h.float() * g.float()).to(h.dtype), partials)


def test_the_checks_catch_wrong_statistics_a_missing_weight_and_a_lost_program():
    case = EpilogueCase("probe", None, 4, 40, 48, 24)
    x, w1, residual, g, w2, b = make_inputs(case, torch.float32, "cpu", seed=5)
    ref_h, ref_y = reference(x, w1, residual, g, w2, b, EPS)
    good = _torch_prenormed(x, w1, residual, g, programs=3)
    rstd = torch.rsqrt(good.partials[:, :4].sum(0) / 48 + EPS)
    y = F.linear(good.u * rstd[:, None], w2)
    assert check(good, y, g, ref_h, ref_y, torch.float32)["ok"]
    # Every row scaled by row 0's rstd (the rows are at different scales).
    assert not check(good, F.linear(good.u * rstd[0], w2), g, ref_h, ref_y, torch.float32)["ok"]
    # u without the norm weight.
    no_weight = Prenormed(good.h, good.h.clone(), good.partials)
    assert not check(no_weight, y, g, ref_h, ref_y, torch.float32)["ok"]
    # One program's partials lost.
    lost = Prenormed(good.h, good.u, good.partials.clone())
    lost.partials[1] = 0
    assert not check(lost, y, g, ref_h, ref_y, torch.float32)["ok"]


def test_the_check_catches_a_residual_add_that_skips_torchs_rounding():
    # In fp16 the GEMV's output must be rounded before the residual add, as the two-step path does:
    # adding the fp32 sum instead stays within the tolerance but changes many elements of h.
    case = EpilogueCase("probe", None, 5, 75, 72, 37)
    x, w1, residual, g, w2, b = make_inputs(case, torch.float16, "cpu", seed=7)
    ref_h, ref_y = reference(x, w1, residual, g, w2, b, EPS)

    def prenormed(h):
        partials = torch.zeros(1, 16)
        partials[0, :5] = h.float().pow(2).sum(-1)
        return Prenormed(h, (h.float() * g.float()).to(h.dtype), partials)

    unrounded = (F.linear(x.double(), w1.double()) + residual.double()).to(torch.float16)
    assert check(prenormed(ref_h), ref_y, g, ref_h, ref_y, torch.float16)["ok"]
    result = check(prenormed(unrounded), ref_y, g, ref_h, ref_y, torch.float16)
    assert not result["ok"] and result["h_rel"] <= 2e-3, result  # caught by the bit count only


def test_dispatch_takes_2_to_64_bf16_rows_of_a_small_model_on_triton_only():
    enabled = linear_ops.NORM_EPILOGUE_ENABLED and linear_ops.GEMV_ENABLED and fused_ops.FUSED_KERNELS_ENABLED
    w, g = torch.randn(24, 32).bfloat16(), torch.rand(24).bfloat16()

    def uses(rows, dtype=torch.bfloat16, backend="triton", norm=g, residual_cols=24, weight=w):
        x = torch.randn(rows, 32).to(dtype)
        r = torch.randn(rows, residual_cols).to(dtype)
        return linear_ops.uses_norm_epilogue(x, weight.to(dtype), r, norm.to(dtype), backend)

    assert not uses(5, backend=None)  # the CPU: the reference backend
    for rows in (2, 5, 16, 17, 40, 64):
        assert uses(rows) == (enabled and rows <= linear_ops.GEMV_MAX_ROWS)
    assert not uses(1) and not uses(65)  # one row has its own fold; past 64 the norm kernel
    assert not uses(5, torch.float16)  # h * g could overflow fp16
    assert not uses(5, norm=g[:16])  # a norm of another width
    assert not uses(5, residual_cols=16)  # a residual of another shape
    # A wide block output (the next GEMV's K past a small model's): 16 rows at most, since at
    # 17-64 rows the next GEMV may run torch's GEMM, which cannot finish the norm.
    wide = linear_ops.SMALL_MODEL_MAX_K + 8
    w_wide, g_wide = torch.randn(wide, 32).bfloat16(), torch.rand(wide).bfloat16()
    assert uses(16, norm=g_wide, residual_cols=wide, weight=w_wide) == enabled
    assert not uses(17, norm=g_wide, residual_cols=wide, weight=w_wide)


def test_every_small_model_k_has_a_dot_config_at_2_to_64_rows():
    # What the dispatch above relies on: the next GEMV (K = this block's output width) takes a
    # dot config, so its epilogue can finish the norm.
    from pagedinfer.kernels import gemv

    for rows in (2, 16, 17, 40, 64):
        for k in (64, 576, 1536, linear_ops.SMALL_MODEL_MAX_K):
            for n in (64, 960, 3072, 8192, 9728, 17920, 49152, 128256):
                config = gemv.config_for(rows, n, k)
                assert config is not None and config.variant == "dot", (rows, n, k, config)


def test_the_cpu_path_is_the_plain_linear_and_leaves_the_residual_alone():
    x, w, r, g = torch.randn(3, 32), torch.randn(24, 32), torch.randn(3, 24), torch.rand(24)
    y, residual = linear_ops.linear_residual(x, w, r, g)
    assert residual is r and torch.equal(y, F.linear(x, w))


@pytest.mark.parametrize("rows,row_tile", [(3, 16), (40, 64)])
def test_the_torch_fallback_finishes_the_norm_like_the_two_step_path(rows, row_tile):
    # A Prenormed on a path without the kernel (no fitting config): rstd from the partials in torch.
    case = EpilogueCase("fallback", None, rows, 40, 48, 24, bias=True)
    x, w1, residual, g, w2, b = make_inputs(case, torch.float32, "cpu", seed=6)
    ref_h, ref_y = reference(x, w1, residual, g, w2, b, EPS)
    pre = _torch_prenormed(x, w1, residual, g, programs=2, row_tile=row_tile)
    y, h = linear_ops.norm_linear(pre, None, g, EPS, w2, b)
    assert h is pre.h
    assert float(((y.double() - ref_y).norm(dim=-1) / ref_y.norm(dim=-1)).max()) < 1e-5
    with pytest.raises(ValueError, match="does not take rows"):
        linear_ops.norm_linear(pre, None, g, EPS, w2[:, :16])


def test_rstd_linear_refuses_partials_of_another_row_tile():
    from pagedinfer.kernels import gemv, norm_epilogue

    u = torch.randn(40, 32).bfloat16()
    pre = Prenormed(u, u, torch.zeros(2, 16))  # 40 rows take a 64-row tile
    with pytest.raises(ValueError, match="not those of 40 rows"):
        norm_epilogue.rstd_linear(pre, EPS, torch.randn(24, 32).bfloat16(), None, gemv.DOT_CONFIG)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "rows,k_in,hidden,n_out,bias",
    [
        (rows, *shape)
        for rows in (2, 5, 16, 40, 64)
        for shape in (
            (1536, 576, 960, False),  # SmolLM2 down -> the next layer's qkv
            (576, 576, 3072, False),  # SmolLM2 o_proj -> gate_up
            (896, 896, 1152, True),  # Qwen2-0.5B: an 896-wide block output -> qkv (bias)
            (2048, 2048, 16384, False),  # Llama-3.2-1B o_proj -> gate_up (wider than 8192)
        )
    ]
    + [
        (rows, *shape)
        for rows in (2, 5, 16)  # (past 16 rows the 8B keeps the norm kernel)
        for shape in (
            (14336, 4096, 6144, False),  # 8B down -> the next layer's qkv
            (4096, 4096, 28672, False),  # 8B o_proj -> gate_up
        )
    ],
)
def test_engine_configs_at_full_shapes(rows, k_in, hidden, n_out, bias):
    from pagedinfer.kernels import gemv, norm_epilogue

    case = EpilogueCase("gpu", None, rows, k_in, hidden, n_out, bias=bias)
    x, w1, residual, g, w2, b = make_inputs(case, torch.bfloat16, "cuda", seed=rows + k_in)
    pre, written_rows = prenorm_with_poisoned_pad(x, w1, residual, g, gemv.config_for(rows, hidden, k_in))
    y = norm_epilogue.rstd_linear(pre, EPS, w2, b, gemv.config_for(rows, n_out, hidden))
    result = check(pre, y, g, *reference(x, w1, residual, g, w2, b, EPS), torch.bfloat16, written_rows)
    assert result["ok"], result
    # The launchers the model calls run the same kernels (unless switched off for the run).
    if linear_ops.uses_norm_epilogue(x, w1, residual, g, None):
        pre2, none = linear_ops.linear_residual(x, w1, residual, g)
        y2, h2 = linear_ops.norm_linear(pre2, none, g, EPS, w2, b)
        assert none is None and torch.equal(h2, pre.h) and torch.equal(y2, y)
