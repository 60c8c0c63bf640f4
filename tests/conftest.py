"""Session setup for every test area.

`python -m pytest` (scripts/test.sh, bench/run_gpu.sh) puts the repository root first on
sys.path. There the source folder kernels/ (installed as pagedinfer.kernels) would shadow Hugging
Face's `kernels` package, which transformers 5.2x requires and imports: `from kernels import
CUDAProperties` then fails inside every transformers model. The root moves to the end of the
path: installed packages win, and `tests.*` helpers still import from it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
_AT_ROOT = [p for p in sys.path if os.path.abspath(p or os.curdir) == _ROOT]
if _AT_ROOT:
    sys.path[:] = [p for p in sys.path if p not in _AT_ROOT] + [_ROOT]


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ARG001
    """One line per real-Kubernetes marker counting its tests by outcome, so a CI log shows they ran."""
    where = os.environ.get("KUBECONFIG") or "no KUBECONFIG"
    for marker, what in (("cluster", "real-cluster"), ("node", "real-node")):
        counts: dict[str, int] = {}
        for outcome in ("passed", "failed", "error", "skipped"):
            for report in terminalreporter.stats.get(outcome, []):
                if marker not in getattr(report, "keywords", {}) or report.when not in ("call", "setup"):
                    continue
                if outcome == "passed" and report.when != "call":
                    continue
                counts[outcome] = counts.get(outcome, 0) + 1
        line = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none collected"
        terminalreporter.write_line(f"{what} tests (marker {marker}, {where}): {line}")
