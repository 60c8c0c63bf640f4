"""The operator image installs the pagedinfer wheel with --no-deps plus docker/requirements-operator.txt.
Prove that is enough: with every other distribution made unimportable, the CLI and every
operator module still import (and torch never loads)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "docker" / "requirements-operator.txt"


def _requirements() -> dict[str, str]:
    reqs = {}
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9][A-Za-z0-9.]*)", line)
            assert m, f"not pinned with ==: {line}"
            reqs[m.group(1).lower()] = m.group(2)
    return reqs


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_requirements_are_pinned_project_dependencies():
    reqs = _requirements()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = {_norm(re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0]) for d in deps}
    # aiohttp arrives through kopf in the full install; the operator's /metrics server imports it.
    assert {_norm(n) for n in reqs} - declared <= {"aiohttp"}
    assert "torch" not in reqs


def test_requirements_match_the_tested_versions():
    from importlib.metadata import version

    for name, pinned in _requirements().items():
        assert version(name) == pinned, f"{name}: tests run {version(name)}, the image pins {pinned}"


BLOCKER = r"""
import importlib, importlib.metadata as md, pkgutil, re, sys

norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
# paged-infer itself is in (installed --no-deps: its own requirements are not followed).
allowed, todo = {"paged-infer"}, [norm(n) for n in sys.argv[1].split(",")]
while todo:  # the transitive closure of the image's requirements
    name = todo.pop()
    if name in allowed:
        continue
    try:
        requires = md.requires(name) or []
    except md.PackageNotFoundError:  # e.g. a backport behind a python_version marker
        continue
    allowed.add(name)
    for req in requires:
        if "extra ==" not in req:
            todo.append(norm(re.split(r"[<>=!~\[; (]", req, maxsplit=1)[0]))
owners = md.packages_distributions()

# Outside the image means not installed: None in sys.modules makes `import x` raise
# ModuleNotFoundError and importlib.util.find_spec("x") return None, as both do for a missing
# package (libraries probe optional ones that way: python-json-logger looks for orjson).
for top, dists in owners.items():
    if not {norm(d) for d in dists} & allowed and top not in sys.modules:
        sys.modules[top] = None
from pagedinfer.engine.cli import build_parser
build_parser()
import pagedinfer.operator as op
for mod in pkgutil.walk_packages(op.__path__, "pagedinfer.operator."):
    if mod.name.rsplit(".", 1)[-1] not in ("testing", "conftest"):
        importlib.import_module(mod.name)
assert sys.modules.get("torch") is None  # blocked (None) or never imported
print("ok", len(sys.modules))
"""


def test_operator_imports_with_only_the_image_requirements():
    names = ",".join(_requirements())
    proc = subprocess.run(
        [sys.executable, "-P", "-c", BLOCKER, names], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok")


def test_blocker_really_blocks():
    """Without pydantic (the spec models) in the allowed set, importing the operator must fail."""
    names = ",".join(n for n in _requirements() if n != "pydantic")
    proc = subprocess.run(
        [sys.executable, "-P", "-c", BLOCKER, names], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode != 0 and "pydantic" in proc.stderr
