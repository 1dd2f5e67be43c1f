"""A deployed aenv has its runtime dependencies only, never the test extras: every third-party
module its code imports must come with them and the `server` extra (the `aenv` command once
needed `e2b` from the test extras, so `aenv --version` failed in the server image). The CLI alone
(`pip install aenv`, no extra) imports nothing of the server's dependencies."""

from __future__ import annotations

import ast
import subprocess
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


def runtime_closure(*extras: str) -> set[str]:
    """The distributions the package's own dependencies (and those of `extras`) bring, transitively."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + [s for e in extras for s in project["optional-dependencies"][e]]
    pending = [Requirement(spec) for spec in specs]
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
    closure = runtime_closure("server")
    missing = {
        module for module in imported_modules()
        if not {canonicalize_name(d) for d in providers.get(module, [module])} & closure
    }  # fmt: skip
    assert not missing, f"imported but not a runtime dependency: {sorted(missing)}"


# Run in a fresh interpreter that cannot import the server's dependencies: every CLI module
# imports, `--help` works, a client command fails only for want of a node, and a server command
# says which extra to install.
CLIENT_ONLY = """
import importlib, pkgutil, sys
BLOCKED = set(sys.argv[1].split(","))

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)

sys.meta_path.insert(0, Blocker())
import aenv.cli
for module in pkgutil.iter_modules(aenv.cli.__path__):
    if module.name != "__main__":
        importlib.import_module("aenv.cli." + module.name)
for argv in (["--help"], ["template", "build", "--help"]):
    try:
        aenv.cli.main(argv)
    except SystemExit as exc:
        assert exc.code == 0, argv
print(aenv.cli.main(["ls"]), aenv.cli.main(["server"]), aenv.cli.main(["node", "ls", "--scheduler-url", "x"]))
"""


def test_the_cli_needs_no_server_dependency() -> None:
    providers = metadata.packages_distributions()
    server_only = runtime_closure("server") - runtime_closure()
    blocked = {m for m, dists in providers.items() if {canonicalize_name(d) for d in dists} <= server_only}
    assert {"aiohttp", "numpy", "pydantic", "pyroute2", "boto3", "redis"} <= blocked
    env = {"AENV_URL": "http://127.0.0.1:9", "AENV_API_KEY": "k", "PYTHONPATH": str(REPO / "src")}
    result = subprocess.run(
        [sys.executable, "-c", CLIENT_ONLY, ",".join(sorted(blocked))],
        capture_output=True, text=True, timeout=60, env=env, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-3:] == ["1", "1", "1"], result.stdout
    assert result.stderr.count("pip install 'aenv[server]'") == 2, result.stderr
