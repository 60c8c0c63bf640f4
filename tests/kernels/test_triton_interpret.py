"""Every Triton kernel under TRITON_INTERPRET=1 against the float64 reference, on the CPU.

The interpreter must be enabled before triton is imported, so the cases run in one subprocess
(kernels/testing.py's main) and each case's result is checked here.
"""

from __future__ import annotations

import pytest

from pagedinfer.kernels.testing import INTERPRETER_CASES, INTERPRETER_DTYPES
from tests.kernels.interpreter_run import run_interpreter_cases

pytest.importorskip("triton")

CASE_IDS = [
    (case.name, str(dtype).removeprefix("torch."))
    for case in INTERPRETER_CASES
    for dtype in INTERPRETER_DTYPES
]


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory) -> dict[tuple[str, str], dict]:
    return run_interpreter_cases("pagedinfer.kernels.testing", tmp_path_factory.mktemp("interp"))


@pytest.mark.parametrize("name,dtype", CASE_IDS, ids=[f"{n}-{d}" for n, d in CASE_IDS])
def test_triton_kernel_matches_reference(interpreter_results, name, dtype):
    result = interpreter_results[(name, dtype)]
    assert result["rel_err"] <= result["tolerance"], result
