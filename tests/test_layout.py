"""The repository layout keeps its promises: one import root, no stdlib shadowing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = [
    "operator",
    "engine",
    "native",
    "kernels",
    "proto",
    "charts",
    "manifests",
    "docker",
    "tests",
    "bench",
]


def test_top_level_folders_exist():
    for name in TOP_LEVEL:
        assert (ROOT / name).is_dir(), name
    for name in ["pyproject.toml", "LICENSE", "README.md", ".ci/run"]:
        assert (ROOT / name).is_file(), name


def test_operator_folder_does_not_shadow_stdlib():
    # Python started in the repository root puts '' (the root) first on sys.path.
    assert not (ROOT / "operator" / "__init__.py").exists()
    subprocess.run(
        [sys.executable, "-c", "import collections, torch, operator; operator.itemgetter"],
        cwd=ROOT,
        check=True,
    )
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "tests/test_layout.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_one_import_root():
    code = "import pagedinfer._native, pagedinfer.engine, pagedinfer.kernels, pagedinfer.operator"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
