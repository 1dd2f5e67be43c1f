"""No import circles between the modules of `aenv` (issue 33): each module's imports, type-only
ones included, read with `ast`, form a graph that must have no cycle. A circle means two modules
each need the other to be understood; the fix is a module both can import, not a late import.
Runs in about a second, without importing anything."""

from __future__ import annotations

import ast
from pathlib import Path

import aenv

ROOT = Path(aenv.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, modules: set[str]) -> set[str]:
    """The `aenv` modules `path` imports (a `from package import name` counts the submodule
    `name` when there is one, else the package)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(paths)
    return {name: imported(path, modules) for name, path in paths.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_relative_and_type_only_imports() -> None:
    edges = graph()
    assert "aenv.orchestrator.states" in edges["aenv.orchestrator.store"]
    assert "aenv.orchestrator.service" in edges["aenv.node"]


def test_no_module_of_aenv_imports_itself_through_others() -> None:
    assert cycles(graph()) == []
