"""The RMSNorm folded into the one-row GEMV (kernels/norm_gemv.py, linear_ops.norm_linear): the
kernel under TRITON_INTERPRET=1 against the two-step reference, the dispatch, the model layer
through both paths, and (marked gpu) the engine's configs at the 8B and SmolLM2 layer shapes."""

from __future__ import annotations

import pytest
import torch

from pagedinfer.kernels import fused_ops, fused_reference, linear_ops
from pagedinfer.kernels.norm_gemv_testing import (
    INTERPRETER_CASES,
    INTERPRETER_DTYPES,
    NormGemvCase,
    check,
    make_inputs,
    reference,
)
from tests.kernels.interpreter_run import run_interpreter_cases

pytest.importorskip("triton")

CASE_IDS = [(c.name, str(d).removeprefix("torch.")) for c in INTERPRETER_CASES for d in INTERPRETER_DTYPES]


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory) -> dict[tuple[str, str], dict]:
    return run_interpreter_cases("pagedinfer.kernels.norm_gemv_testing", tmp_path_factory.mktemp("norm_gemv"))


@pytest.mark.parametrize("name,dtype", CASE_IDS, ids=[f"{n}-{d}" for n, d in CASE_IDS])
def test_norm_gemv_matches_the_two_step_path(interpreter_results, name, dtype):
    result = interpreter_results[(name, dtype)]
    assert result["ok"], result


def test_check_catches_a_missing_norm_and_a_wrong_residual():
    # The tolerance check must reject a GEMV of the un-normed row and a residual that is not x + r.
    case = NormGemvCase("probe", None, 24, 64)  # make_inputs reads the shapes only
    x, residual, g, w, b = make_inputs(case, torch.float32, "cpu", seed=3)
    ref_y, ref_h = reference(x, residual, g, 1e-5, w, b)
    unnormed = torch.nn.functional.linear(x + residual, w)
    assert not check(unnormed, ref_h, ref_y, ref_h, 24, torch.float32)["ok"]
    assert not check(ref_y.float(), x, ref_y, ref_h, 24, torch.float32)["ok"]
    assert check(ref_y.float(), ref_h, ref_y, ref_h, 24, torch.float32)["ok"]


def test_dispatch_folds_only_one_row_on_triton():
    x, g, w = torch.randn(1, 32).half(), torch.rand(32).half(), torch.randn(8, 32).half()
    assert not linear_ops.uses_norm_gemv(x, None, g, w)  # CPU: the reference backend
    expected = linear_ops.GEMV_ENABLED and linear_ops.NORM_GEMV_ENABLED and fused_ops.FUSED_KERNELS_ENABLED
    assert linear_ops.uses_norm_gemv(x, x.clone(), g, w, "triton") == expected
    assert not linear_ops.uses_norm_gemv(torch.randn(2, 32).half(), None, g, w, "triton")  # 2 rows
    assert not linear_ops.uses_norm_gemv(x, None, g.float(), w, "triton")  # mixed dtypes
    assert not linear_ops.uses_norm_gemv(x, None, g[:16], w, "triton")  # wrong norm shape
    assert not linear_ops.uses_norm_gemv(x, None, g, w[:, :16], "triton")  # weight K != x's K
    assert not linear_ops.uses_norm_gemv(x, None, g, w, "triton", torch.zeros(5).half())  # bias shape


def test_the_cpu_path_never_imports_triton(monkeypatch):
    # A CPU-only install (the engine-cpu image) has no Triton: the layer must not need it.
    import sys

    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "pagedinfer.kernels.norm_gemv", None)
    x, r, g, w = torch.randn(1, 32), torch.randn(1, 32), torch.rand(32), torch.randn(8, 32)
    y, h = linear_ops.norm_linear(x, r, g, 1e-6, w)
    normed, hidden = fused_reference.add_rms_norm(x, r, g, 1e-6)
    assert torch.equal(h, hidden) and torch.equal(y, torch.nn.functional.linear(normed, w))


def test_fallback_equals_the_norm_then_the_linear_bit_for_bit():
    # On the CPU norm_linear is the fused norm and then `linear`: the model's numerics unchanged.
    gen = torch.Generator().manual_seed(0)
    x, r = torch.randn(3, 32, generator=gen), torch.randn(3, 32, generator=gen)
    g, w, b = torch.rand(32, generator=gen), torch.randn(8, 32, generator=gen), torch.randn(8, generator=gen)
    y, h = linear_ops.norm_linear(x, r, g, 1e-6, w, b)
    normed, hidden = fused_reference.add_rms_norm(x, r, g, 1e-6)
    assert torch.equal(h, hidden)
    assert torch.equal(y, torch.nn.functional.linear(normed, w, b))
    y0, h0 = linear_ops.norm_linear(x, None, g, 1e-6, w)
    assert h0 is x
    assert torch.equal(y0, torch.nn.functional.linear(fused_reference.rms_norm(x, g, 1e-6), w))


def test_mismatched_norm_weight_is_a_clear_error():
    x, w = torch.randn(1, 32), torch.randn(8, 32)
    with pytest.raises(ValueError, match="weight"):
        linear_ops.norm_linear(x, None, torch.ones(16), 1e-6, w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "first"])
@pytest.mark.parametrize(
    "n,k,bias", [(6144, 4096, False), (28672, 4096, False), (1536, 896, True), (1536, 576, False)]
)
def test_engine_configs_at_full_shapes(dtype, residual, n, k, bias):
    from pagedinfer.kernels import gemv, norm_gemv

    case = NormGemvCase("gpu", gemv.config_for(1, n, k), n, k, residual=residual, bias=bias)
    x, r, g, w, b = make_inputs(case, dtype, "cuda", seed=n + k)
    y, h = norm_gemv.add_norm_gemv(x, r, g, 1e-5, w, b, case.config)
    result = check(y, h, *reference(x, r, g, 1e-5, w, b), n, dtype)
    assert result["ok"], result
    # And through the launcher the model calls: the same kernel (unless switched off for the run).
    if linear_ops.uses_norm_gemv(x, r, g, w, None, b):
        y2, _ = linear_ops.norm_linear(x, r, g, 1e-5, w, b)
        assert torch.equal(y2, y)


def test_a_norm_gemv_that_does_not_fit_the_gpu_runs_the_two_step_path(monkeypatch):
    from triton.runtime.errors import OutOfResources

    from pagedinfer.kernels import gemv, norm_gemv

    calls = []

    def too_big(*args, **kwargs):
        calls.append(1)
        raise OutOfResources(150_000, 101_376, "shared memory")

    def reference_norm(x, residual, weight, eps, backend=None):  # no Triton norm kernel on the CPU
        return fused_reference.add_rms_norm(x, residual, weight, eps)

    monkeypatch.setattr(norm_gemv, "add_norm_gemv", too_big)
    monkeypatch.setattr(gemv, "gemv", too_big)
    monkeypatch.setattr(linear_ops, "_UNFIT_CONFIGS", set())
    monkeypatch.setattr(linear_ops, "GEMV_ENABLED", True)
    monkeypatch.setattr(linear_ops, "NORM_GEMV_ENABLED", True)
    monkeypatch.setattr(linear_ops.fused_ops, "FUSED_KERNELS_ENABLED", True)
    monkeypatch.setattr(linear_ops.fused_ops, "add_rms_norm", reference_norm)
    gen = torch.Generator().manual_seed(1)
    x, r = (torch.randn(1, 32, generator=gen).half() for _ in range(2))
    g, w = torch.rand(32, generator=gen).half(), torch.randn(8, 32, generator=gen).half()
    y, h = linear_ops.norm_linear(x, r, g, 1e-6, w, None, "triton")
    normed, hidden = fused_reference.add_rms_norm(x, r, g, 1e-6)
    assert torch.equal(h, hidden)
    assert torch.equal(y, torch.nn.functional.linear(normed, w))
    assert len(calls) == 3  # the folded kernel, the GEMV, its default tile: all fell back
