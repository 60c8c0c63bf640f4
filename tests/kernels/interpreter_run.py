"""Runs a module's interpreter cases in a subprocess with TRITON_INTERPRET=1 (which must be set
before triton is imported) and returns its per-case results keyed by (case name, dtype)."""

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
