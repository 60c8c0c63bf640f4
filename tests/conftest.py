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
    """One line counting the real-cluster tests by outcome, so a CI log shows they ran."""
    counts: dict[str, int] = {}
    for outcome in ("passed", "failed", "error", "skipped"):
        for report in terminalreporter.stats.get(outcome, []):
            if "cluster" in getattr(report, "keywords", {}) and report.when in ("call", "setup"):
                if outcome == "passed" and report.when != "call":
                    continue
                counts[outcome] = counts.get(outcome, 0) + 1
    line = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none collected"
    where = os.environ.get("KUBECONFIG") or "no KUBECONFIG"
    terminalreporter.write_line(f"real-cluster tests (marker cluster, {where}): {line}")
