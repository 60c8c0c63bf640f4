"""kernels/ops.launch_or_fallback: a kernel that does not build on this GPU (a Triton compile error,
ptxas refusing its PTX, or a resource limit) is replaced by the torch ops, logged once and never tried again; any other
error is the caller's."""

from __future__ import annotations

import ast
import logging

import pytest

pytest.importorskip("triton")

from triton.compiler.errors import CompilationError  # noqa: E402
from triton.runtime.errors import OutOfResources, PTXASError  # noqa: E402

from pagedinfer.kernels import ops  # noqa: E402


@pytest.mark.parametrize(
    "error",
    [
        CompilationError("src", ast.parse("x").body[0], "bad cast"),
        PTXASError("ptxas fatal: Unresolved extern function"),
        OutOfResources(300000, 232448, "shared memory"),
    ],
    ids=["compile", "ptxas", "resources"],
)
def test_a_kernel_that_does_not_build_falls_back_once_and_for_good(monkeypatch, caplog, error):
    monkeypatch.setattr(ops, "_FAILED_KERNELS", set())
    calls = []

    def launch():
        calls.append("kernel")
        raise error

    with caplog.at_level(logging.WARNING):
        assert ops.launch_or_fallback("k", launch, lambda: "torch") == "torch"
        assert ops.launch_or_fallback("k", launch, lambda: "torch") == "torch"
    assert calls == ["kernel"]  # not tried again
    assert sum("kernel k failed to build" in r.message for r in caplog.records) == 1
    assert ops.launch_or_fallback("other", lambda: "kernel", lambda: "torch") == "kernel"


def test_other_errors_are_raised(monkeypatch):
    monkeypatch.setattr(ops, "_FAILED_KERNELS", set())

    def launch():
        raise RuntimeError("CUDA error: an illegal memory access")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        ops.launch_or_fallback("k", launch, lambda: "torch")
    assert ops.launch_or_fallback("k", lambda: "kernel", lambda: "torch") == "kernel"
