"""The operator's import boundaries (import-linter cannot see the namespace package, so an AST walk):
no torch or engine imports (the operator image carries neither); only k8s.py loads API credentials."""

from __future__ import annotations

import ast
from pathlib import Path

OPERATOR = Path(__file__).resolve().parents[2] / "operator"


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_torch_or_engine():
    for path in OPERATOR.rglob("*.py"):
        for name in imports(path):
            assert not name.startswith(("torch", "pagedinfer.engine")), (path, name)


def test_only_k8s_module_loads_credentials():
    for path in OPERATOR.rglob("*.py"):
        if path.name in ("k8s.py", "testing.py"):
            continue
        for name in imports(path):
            assert not name.startswith("kubernetes_asyncio.config"), (path, name)
