"""kernels/argmax.py against torch.argmax: the Triton kernel under TRITON_INTERPRET=1 on the CPU
(one subprocess runs every case, since the interpreter must be on before triton is imported),
and at vocabulary sizes on CUDA (marker gpu).

Cases aim at what a split reduction gets wrong: ties inside one 2048-column piece and across
pieces (the first index must win), the maximum in the last partial piece, rows of -inf, NaN, a
row stride wider than the row (a vocabulary slice), and one piece only (a small vocabulary).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.interpreter_run import run_interpreted

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_case(name: str, dtype: torch.dtype) -> torch.Tensor:
    """The logits of one case, rebuilt the same way in the interpreter's subprocess."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    if name == "random":  # five pieces, the last partial
        return torch.randn(5, 9000, generator=g).to(dtype)
    if name == "small_vocab":
        return torch.randn(3, 37, generator=g).to(dtype)
    if name == "ties":
        # few distinct values: every row has its maximum many times over, in many lanes
        return torch.randint(0, 4, (6, 5000), generator=g).to(dtype)
    if name == "tie_same_lane":
        # the maximum at columns 4097 and 8193 (later pieces) and at 9 (the first piece)
        x = torch.zeros(2, 8200, dtype=dtype)
        x[0, [4097, 8193]] = 1.0
        x[1, [8193, 9, 4097]] = 2.0
        return x
    if name == "max_in_tail":
        x = torch.randn(2, 4100, generator=g).to(dtype)
        x[:, 4099] = 100.0
        return x
    if name == "neg_inf":
        x = torch.full((3, 300), float("-inf"), dtype=dtype)
        x[1, 77] = -1e4  # one finite value
        return x
    if name == "nan":
        x = torch.randn(2, 600, generator=g).to(dtype)
        x[0, 500] = float("nan")
        x[1, 3] = float("nan")
        x[1, 400] = float("nan")
        return x
    if name == "inf_then_nan":
        # +inf before a NaN, in one piece (row 0) and in two pieces (row 1): the NaN wins, as in
        # torch; +inf in two pieces and no NaN (row 2): the first +inf
        x = torch.randn(3, 4100, generator=g).to(dtype)
        x[0, 10], x[0, 50] = float("inf"), float("nan")
        x[1, 3000], x[1, 3500] = float("inf"), float("nan")
        x[2, 2100], x[2, 4000] = float("inf"), float("inf")
        return x
    if name == "strided":  # every other row of a wider buffer, then the first 700 of its 1000 columns
        return torch.randn(8, 1000, generator=g).to(dtype)[::2, :700]
    raise KeyError(name)


CASES = (
    "random",
    "small_vocab",
    "ties",
    "tie_same_lane",
    "max_in_tail",
    "neg_inf",
    "nan",
    "inf_then_nan",
    "strided",
)


def _run_interpreter(out: str) -> None:
    from pagedinfer.kernels.argmax import argmax_rows_kernel

    results = {}
    for name in CASES:
        for dname, dtype in DTYPES.items():
            results[f"{name}/{dname}"] = argmax_rows_kernel(make_case(name, dtype)).tolist()
    Path(out).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted("tests.kernels.test_argmax", tmp_path_factory.mktemp("argmax") / "out.json")


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("name", CASES)
def test_interpreter_matches_torch(interpreted, name, dname):
    x = make_case(name, DTYPES[dname])
    assert interpreted[f"{name}/{dname}"] == x.argmax(dim=-1).tolist()


def test_expected_answers_of_hand_made_cases():
    """The cases mean what they say: torch's answers on them, as written above."""
    assert make_case("tie_same_lane", torch.float32).argmax(-1).tolist() == [4097, 9]
    assert make_case("neg_inf", torch.float32).argmax(-1).tolist() == [0, 77, 0]
    assert make_case("nan", torch.float32).argmax(-1).tolist() == [500, 3]
    assert make_case("max_in_tail", torch.float32).argmax(-1).tolist() == [4099, 4099]
    assert make_case("inf_then_nan", torch.float32).argmax(-1).tolist() == [50, 3500, 2100]


def test_cpu_default_is_torch_and_bad_shape_is_refused():
    from pagedinfer.kernels.argmax import argmax_rows

    x = torch.randn(4, 50)
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        argmax_rows(torch.randn(2, 3, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 8, 40, 56])
@pytest.mark.parametrize("vocab", [49152, 128256])
@pytest.mark.parametrize("dname", ["bfloat16", "float16", "float32"])
def test_gpu_matches_torch(rows, vocab, dname):
    from pagedinfer.kernels.argmax import argmax_rows, argmax_rows_kernel

    g = torch.Generator(device="cuda").manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, device="cuda", generator=g).to(DTYPES[dname])
    x[0, vocab - 1] = 50.0  # a maximum in the last tile
    if rows > 1:
        x[1, 5] = x[1, 4000] = 50.0  # a tie: the first wins
    assert torch.equal(argmax_rows_kernel(x), x.argmax(-1))
    # ties everywhere: a handful of distinct values
    y = torch.randint(0, 3, (rows, vocab), device="cuda", generator=g).to(DTYPES[dname])
    assert torch.equal(argmax_rows_kernel(y), y.argmax(-1))
    assert torch.equal(argmax_rows(y), y.argmax(-1))  # the engine's entry
    # NaN and infinities (compiled code, where the interpreter's numpy could hide a difference)
    z = torch.full((rows, vocab), float("-inf"), device="cuda").to(DTYPES[dname])
    z[0, vocab // 2], z[0, vocab - 3] = float("inf"), float("nan")
    assert torch.equal(argmax_rows_kernel(z), z.argmax(-1))


if __name__ == "__main__":
    _run_interpreter(sys.argv[1])
