"""Runs a module's interpreter cases in a subprocess with TRITON_INTERPRET=1 (which must be set
before triton is imported): `run_interpreter_cases` returns its per-case results keyed by (case
name, dtype); `run_interpreted` runs a test module's `__main__` and returns the JSON it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_interpreter_cases(module: str, out_dir: Path) -> dict[tuple[str, str], dict]:
    out = out_dir / "results.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", module, str(out)],
        env=env,
        cwd=out_dir,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return {(r["name"], r["dtype"]): r for r in json.loads(out.read_text())}


REPO = Path(__file__).resolve().parents[2]


def run_interpreted(module: str, out: Path, without_switches: bool = False) -> object:
    """`python -m module OUT` from the repository root under TRITON_INTERPRET=1 -> OUT's JSON.

    without_switches drops the PAGEDINFER_* kernel switches from its environment (a test that
    compares paths pins the ones it needs and must not inherit the others)."""
    env = {k: v for k, v in os.environ.items() if not (without_switches and k.startswith("PAGEDINFER_"))}
    env.update(TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]))
    cmd = [sys.executable, "-m", module, str(out)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())
