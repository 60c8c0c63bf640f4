"""Recompute the full-batch columns of a bench/speculative.py JSON from its rows' step traces.

    python -P bench/speculative_windows.py bench/results/speculative_h100_ngram_0300.json

Rows since 2026-12-06 carry `step_trace` (both runs, every step); this applies the current
window of speculative_report (full-batch ratio, vstep, tok/f) to them, e.g. after the window's
definition changed, and prints the recorded values beside the recomputed ones.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative_report import (  # noqa: E402  (bench/ is not a package)
    all_steps_columns,
    full_batch_columns,
    steps_from_trace,
)
from throughput_lib import EngineRun  # noqa: E402


def run_from_trace(trace: list[list]) -> EngineRun:
    return EngineRun(0.0, 0, 0, 0, steps_from_trace(trace))


def recompute(row: dict) -> dict:
    """The row's full-batch columns from its traces: the theory at the window's own alpha where
    the trace has per-step verification counts, else at the whole run's (as recorded then)."""
    base, fast = (run_from_trace(row["step_trace"][name]) for name in ("base", "spec"))
    window = full_batch_columns(base, fast, row["batch"], row["k"], row["c"], row["theoretical_speedup"])
    return {**window, **all_steps_columns(row)}


COLUMNS = ("full_batch_over_theoretical", "verify_step_cost", "tokens_over_formula")  # printed
# against the theory at alpha over every sequence-step asked for drafts: whole run, per request,
# full batch
ALL_STEPS = (
    "measured_over_theoretical_all_steps",
    "request_over_theoretical_all_steps",
    "full_batch_over_theoretical_all_steps",
)


def main(path: str) -> None:
    results = json.loads(Path(path).read_text())
    print(
        "workload   B  K  recorded ratio/vstep/tok/f   recomputed ratio/vstep/tok/f   window alpha"
        "   all steps: run/request/full-B"
    )
    for name, workload in results["workloads"].items():
        for row in workload["rows"]:
            if "step_trace" not in row:
                continue
            new = recompute(row)
            old, now = ([r.get(k) for k in COLUMNS] for r in (row, new))
            all_steps = [new.get(k) for k in ALL_STEPS]
            print(
                f"{name:8} {row['batch']:3} {row['k']:2}  {old!s:28} {now!s:28} "
                f"{new['full_batch_alpha']!s:12} {all_steps}"
            )


if __name__ == "__main__":
    main(sys.argv[1])
