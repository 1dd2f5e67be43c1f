"""A deployed aenv has its runtime dependencies only, never the test extras: every third-party
module its code imports must come with them (the `aenv` command once needed `e2b` from the test
extras, so `aenv --version` failed in the server image)."""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from .wiring import REPO


def imported_modules() -> set[str]:
    """Top-level names of the third-party modules src/aenv imports."""
    names = set()
    for path in (REPO / "src" / "aenv").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"aenv", "__future__"}


def runtime_closure() -> set[str]:
    """The distributions the package's own dependencies bring, transitively (no extras)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pending = [Requirement(spec) for spec in project["dependencies"]]
    seen: set[str] = set()
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in seen or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        pending.extend(Requirement(spec) for spec in metadata.requires(requirement.name) or [])
    return seen


def test_imports_come_with_the_runtime_dependencies() -> None:
    providers = metadata.packages_distributions()
    closure = runtime_closure()
    missing = {
        module for module in imported_modules()
        if not {canonicalize_name(d) for d in providers.get(module, [module])} & closure
    }  # fmt: skip
    assert not missing, f"imported but not a runtime dependency: {sorted(missing)}"
