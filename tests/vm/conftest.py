"""The envd SDK suite's fixtures, backed by a real VM restored from the base template."""

from __future__ import annotations

import secrets

import pytest


@pytest.fixture(scope="session")
def vm_sandbox(base_template, session_sandboxes):
    """One running sandbox from the base template, shared by the SDK tests."""
    return session_sandboxes.start(base_template.id)


@pytest.fixture(scope="session")
def sandbox(vm_sandbox):
    return vm_sandbox.sdk()


@pytest.fixture
def workdir(sandbox) -> str:
    """A fresh directory in the guest that any user may write to."""
    path = f"/tmp/work-{secrets.token_hex(4)}"
    sandbox.commands.run(f"mkdir -p {path} && chmod 1777 {path}", user="root")
    return path
