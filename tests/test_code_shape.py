"""The code's shape, checked by walking its source with ast (no import runs): in engine/,
kernels/ and operator/ no import cycle (an import inside a function counts too: it hides the
cycle, it does not remove it), no private name (`_x`) imported from another module, and no
file over MAX_LINES lines."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("engine", "kernels", "operator")  # each maps to pagedinfer.<folder>
MAX_LINES = 500
# Files allowed past MAX_LINES, each with the reason it cannot be split by responsibility.
LONG_FILES: dict[str, str] = {}


def _module_name(path: Path) -> str:
    parts = ("pagedinfer", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))}


def _imported(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a `from X import ...` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _imports(module: str, path: Path, modules: set[str]) -> Iterator[tuple[str, str | None, int]]:
    """(imported module, name taken from it or None, line) for every import in the file, at any
    depth; a `from package import submodule` is an import of the submodule."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            source = _imported(module, path, node)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:
                    yield submodule, None, node.lineno
                else:
                    yield source, alias.name, node.lineno


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    """The import graph between the project's modules, and the private-name imports found."""
    sources = _sources()
    modules = set(sources)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    private: list[str] = []
    for module, path in sources.items():
        for target, name, line in _imports(module, path, modules):
            if target in modules and target != module:
                graph[module].add(target)
            is_private = name is not None and name.startswith("_") and not name.startswith("__")
            if is_private and target != module and target.startswith("pagedinfer."):
                private.append(f"{path.relative_to(ROOT)}:{line} imports {name} from {target}")
    return graph, private


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def _one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest import path from the component's first module back to itself (for the message)."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    return [*paths[node], start]
                if child not in paths:
                    paths[child] = [*paths[node], child]
                    nxt.append(child)
        frontier = nxt
    return component


def test_no_import_cycles():
    graph, _ = _graph()
    cycles = [f"{' -> '.join(_one_cycle(graph, c))} (all of: {', '.join(c)})" for c in _cycles(graph)]
    assert not cycles, "import cycles (move the shared piece to a module both can import):\n" + "\n".join(
        cycles
    )


def test_no_private_names_imported_across_modules():
    _, private = _graph()
    assert not private, (
        "private names imported from another module (make the shared helper public, or move it "
        "next to its users):\n" + "\n".join(private)
    )


def test_no_file_over_the_line_limit():
    long = {
        str(p.relative_to(ROOT)): n
        for p in _sources().values()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    over = {f: n for f, n in long.items() if f not in LONG_FILES}
    assert not over, f"files over {MAX_LINES} lines (split them by responsibility): " + ", ".join(
        f"{f} ({n})" for f, n in sorted(over.items(), key=lambda item: -item[1])
    )
    stale = sorted(set(LONG_FILES) - set(long))
    assert not stale, f"LONG_FILES lists files no longer over {MAX_LINES} lines: {stale}"


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    """The walker itself: an import inside a function and a relative import are edges."""
    pkg = tmp_path / "engine"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f():\n    from pagedinfer.engine import b\n")
    (pkg / "b.py").write_text("from .a import _helper\n")
    modules = {"pagedinfer.engine.a", "pagedinfer.engine.b"}
    got_a = list(_imports("pagedinfer.engine.a", pkg / "a.py", modules))
    got_b = list(_imports("pagedinfer.engine.b", pkg / "b.py", modules))
    assert got_a == [("pagedinfer.engine.b", None, 2)]
    assert got_b == [("pagedinfer.engine.a", "_helper", 1)]
    graph = {"pagedinfer.engine.a": {"pagedinfer.engine.b"}, "pagedinfer.engine.b": {"pagedinfer.engine.a"}}
    assert _cycles(graph) == [sorted(graph)]
