"""The fused elementwise kernels under TRITON_INTERPRET=1 against their references, on the CPU.

The interpreter must be enabled before triton is imported, so the cases run in one subprocess
(kernels/fused_testing.py's main) and each case's result is checked here. GPU counterpart:
tests/kernels/test_fused_gpu.py.
"""

from __future__ import annotations

import pytest

from pagedinfer.kernels.fused_testing import INTERPRETER_CASES, INTERPRETER_DTYPES
from tests.kernels.interpreter_run import run_interpreter_cases

pytest.importorskip("triton")

CASE_IDS = [
    (case.name, str(dtype).removeprefix("torch."))
    for case in INTERPRETER_CASES
    for dtype in INTERPRETER_DTYPES
]


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory) -> dict[tuple[str, str], dict]:
    return run_interpreter_cases("pagedinfer.kernels.fused_testing", tmp_path_factory.mktemp("fused_interp"))


@pytest.mark.parametrize("name,dtype", CASE_IDS, ids=[f"{n}-{d}" for n, d in CASE_IDS])
def test_fused_kernel_matches_reference(interpreter_results, name, dtype):
    result = interpreter_results[(name, dtype)]
    assert result["ok"], result
