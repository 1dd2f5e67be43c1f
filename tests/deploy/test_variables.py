"""Every AENV_* variable the documentation and the deployment files name is one the processes
read: a setting of aenv.config.Settings, or one of the few read outside it. A misspelt or
retired name would otherwise be silently ignored by the node it was meant to configure."""

from __future__ import annotations

from pathlib import Path

from .wiring import DEPLOY, PROCESS_VARIABLES, REPO, SETTINGS, variables


def documented_files() -> list[Path]:
    deploy = [p for p in DEPLOY.rglob("*") if p.is_file() and p.name != "secrets.env"]
    return [REPO / "README.md", REPO / "docs" / "deploy.md", *deploy]


def test_documented_variables_are_settings() -> None:
    unknown = {
        f"{path.relative_to(REPO)}: {name}"
        for path in documented_files()
        for name in variables(path.read_text())
        if name not in SETTINGS | PROCESS_VARIABLES
    }
    assert not unknown, sorted(unknown)


def test_variables_read_outside_settings_are_still_read() -> None:
    source = "\n".join(p.read_text() for p in (REPO / "src" / "aenv").rglob("*.py"))
    assert not {name for name in PROCESS_VARIABLES if f'"{name}"' not in source}
