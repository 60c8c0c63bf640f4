"""Small-batch linear kernels (kernels/gemv.py): every variant under TRITON_INTERPRET=1 on the CPU
against fp64 F.linear, the dispatch of kernels/linear_ops.py, and (marked gpu) the engine's
configs at the Llama-3-8B and SmolLM2 layer shapes in bf16/fp16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedinfer.kernels import linear_ops
from pagedinfer.kernels.gemv_testing import INTERPRETER_CASES, INTERPRETER_DTYPES, TOLERANCE
from tests.kernels.interpreter_run import run_interpreter_cases

pytest.importorskip("triton")

CASE_IDS = [(c.name, str(d).removeprefix("torch.")) for c in INTERPRETER_CASES for d in INTERPRETER_DTYPES]


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory) -> dict[tuple[str, str], dict]:
    return run_interpreter_cases("pagedinfer.kernels.gemv_testing", tmp_path_factory.mktemp("gemv_interp"))


@pytest.mark.parametrize("name,dtype", CASE_IDS, ids=[f"{n}-{d}" for n, d in CASE_IDS])
def test_gemv_matches_fp64_linear(interpreter_results, name, dtype):
    result = interpreter_results[(name, dtype)]
    assert result["ok"], result


def test_dispatch_keeps_torch_where_the_kernel_does_not_apply():
    x, w = torch.randn(1, 32), torch.randn(8, 32)
    assert not linear_ops.uses_gemv(x, w)  # CPU: the reference backend
    assert not linear_ops.uses_gemv(x, w, "triton")  # fp32 runs torch's GEMM
    half = x.half(), w.half()
    assert linear_ops.uses_gemv(*half, "triton") == linear_ops.GEMV_ENABLED
    rows = torch.randn(linear_ops.GEMV_MAX_ROWS + 1, 32).half()
    assert not linear_ops.uses_gemv(rows, half[1], "triton")  # a prefill or a large batch
    assert not linear_ops.uses_gemv(half[0], w.half().t().contiguous().t(), "triton")  # strided K
    torch.testing.assert_close(linear_ops.linear(x, w), F.linear(x, w), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
# the reduce variant, the dot variant at 16 rows, and at 40 / 64 (PAGEDINFER_GEMV_MAX_ROWS=64)
@pytest.mark.parametrize("rows", [1, 2, 16, 40, 64])
@pytest.mark.parametrize(
    "n,k",
    [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]  # Llama-3-8B
    + [(960, 576), (576, 1536), (3072, 576), (49152, 576), (1000, 600)],  # SmolLM2, odd edges
)
def test_engine_configs_at_full_shapes(dtype, rows, n, k):
    from pagedinfer.kernels import gemv

    gen = torch.Generator(device="cuda").manual_seed(rows * 7 + n)
    x = torch.randn(rows, k, device="cuda", dtype=dtype, generator=gen)
    w = (torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype, generator=gen)
    # (None: torch's GEMM serves the shape in the engine; the kernel must still be right there)
    out = gemv.gemv(x, w, bias, gemv.config_for(rows, n, k) or gemv.DOT_CONFIG)
    ref = F.linear(x.double(), w.double(), bias.double())
    assert float((out.double() - ref).norm() / ref.norm()) <= TOLERANCE[dtype]
    with torch.inference_mode():  # the layer as the engine calls it, whichever path it takes
        layer = linear_ops.linear(x, w, bias)
    assert float((layer.double() - ref).norm() / ref.norm()) <= TOLERANCE[dtype]


@pytest.mark.parametrize("error", ["out_of_resources", "ptxas"])
def test_a_config_that_does_not_build_for_the_gpu_falls_back_to_torch(monkeypatch, caplog, error):
    # A GPU with less shared memory than the H200 the tiles were sized on: the kernel raises
    # OutOfResources at load time (or ptxas refuses it); the layer must answer with torch's GEMM,
    # and stop retrying.
    from triton.runtime.errors import OutOfResources, PTXASError

    from pagedinfer.kernels import gemv

    calls = []

    def too_big(*args, **kwargs):
        calls.append(1)
        if error == "ptxas":
            raise PTXASError("ptxas fatal: entry function uses too much shared data")
        raise OutOfResources(150_000, 101_376, "shared memory")

    monkeypatch.setattr(gemv, "gemv", too_big)
    monkeypatch.setattr(linear_ops, "_UNFIT_CONFIGS", set())
    monkeypatch.setattr(linear_ops, "GEMV_ENABLED", True)
    x, w = torch.randn(3, 32).half(), torch.randn(8, 32).half()
    with caplog.at_level("WARNING"):
        out = linear_ops.linear(x, w, None, "triton")
        tried = len(calls)  # the routed tile, then the variant's small default tile
        again = linear_ops.linear(x, w, None, "triton")
    torch.testing.assert_close(out, F.linear(x, w), rtol=0, atol=0)
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    assert tried == 2 and len(calls) == tried and "does not build" in caplog.text


def test_a_wide_tile_that_does_not_fit_retries_the_small_dot_tile_first(monkeypatch):
    # On a GPU with ~100 KB of shared memory the 64x256 tile fails where the 32x128 one loads.
    from triton.runtime.errors import OutOfResources

    from pagedinfer.kernels import gemv

    tried = []

    def fits_only_the_default(x, w, b, config):
        tried.append(config)
        if config != gemv.DOT_CONFIG:
            raise OutOfResources(120_000, 101_376, "shared memory")
        return F.linear(x, w, b) + 1  # marks the kernel's answer

    monkeypatch.setattr(gemv, "gemv", fits_only_the_default)
    monkeypatch.setattr(linear_ops, "_UNFIT_CONFIGS", set())
    monkeypatch.setattr(linear_ops, "GEMV_ENABLED", True)
    # wide N, K past a small model's: WIDE_DOT_CONFIG
    x, w = torch.randn(4, 2064).half(), torch.randn(8200, 2064).half()
    out = linear_ops.linear(x, w, None, "triton")
    assert tried == [gemv.WIDE_DOT_CONFIG, gemv.DOT_CONFIG]
    torch.testing.assert_close(out, F.linear(x, w) + 1, rtol=0, atol=0)
    linear_ops.linear(x, w, None, "triton")
    assert tried[2:] == [gemv.DOT_CONFIG]  # the unfit tile is not tried again


def test_a_row_blocked_tile_that_does_not_fit_retries_the_small_dot_tile_on_the_same_blocks(monkeypatch):
    # 40 rows of a small model take 16-row blocks; the retry keeps them (one 64-row tile would
    # need more shared memory than the tile that failed), and the 2-16-row DOT_CONFIG stays usable.
    from dataclasses import replace

    from triton.runtime.errors import OutOfResources

    from pagedinfer.kernels import gemv

    tried = []

    def fits_only_the_default(x, w, b, config):
        tried.append(config)
        if config.block_n != gemv.DOT_CONFIG.block_n or config.block_k != gemv.DOT_CONFIG.block_k:
            raise OutOfResources(120_000, 101_376, "shared memory")
        return F.linear(x, w, b)

    monkeypatch.setattr(gemv, "gemv", fits_only_the_default)
    monkeypatch.setattr(gemv, "ROW_BLOCKS", True)
    monkeypatch.setattr(linear_ops, "_UNFIT_CONFIGS", set())
    monkeypatch.setattr(linear_ops, "GEMV_ENABLED", True)
    x, w = torch.randn(40, 576).half(), torch.randn(576, 576).half()
    linear_ops.linear(x, w, None, "triton")
    assert tried == [gemv.SMALL_ROWS_DOT_CONFIG, replace(gemv.DOT_CONFIG, block_m=16)]
    unfit = linear_ops._UNFIT_CONFIGS
    assert unfit == {gemv.SMALL_ROWS_DOT_CONFIG}  # (DOT_CONFIG stays usable at 2-16 rows)
