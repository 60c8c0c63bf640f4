"""Layering rules import-linter cannot see: the compiled `pagedinfer._native` has one Python user."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {"engine/core/kv_cache_manager.py", "engine/cli.py"}  # cli: the native-demo subcommand


def _imports_native(path: Path) -> bool:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and (
                node.module.startswith("pagedinfer._native")
                or (node.module == "pagedinfer" and any(a.name == "_native" for a in node.names))
            )
        ):
            return True
        if isinstance(node, ast.Import) and any(a.name.startswith("pagedinfer._native") for a in node.names):
            return True
    return False


def test_only_the_kv_cache_manager_imports_native():
    users = {
        str(p.relative_to(ROOT))
        for folder in ("engine", "kernels", "operator")
        for p in (ROOT / folder).rglob("*.py")
        if _imports_native(p)
    }
    assert users <= ALLOWED, f"pagedinfer._native imported outside the KV manager: {sorted(users - ALLOWED)}"
    assert "engine/core/kv_cache_manager.py" in users
