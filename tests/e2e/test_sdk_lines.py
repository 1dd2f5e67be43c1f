"""A command stream cut by a kill reads as "sandbox killed" to the Python SDK's 2.4x line too.

SDK 2.45 has no message of the node to go by: after a dropped stream it probes envd's `/health`
through the proxy and reports the sandbox killed only if that answers 502. The pinned SDK (2.63)
is tested in test_parity.py; 2.45 runs here in a venv of its own (cached like the npm SDK),
never in the project's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import NodeServer

pytestmark = pytest.mark.vm

OLD_SDK = "e2b==2.45.0"

KILLED_BACKGROUND_COMMAND = r"""
import json
from e2b import Sandbox

sandbox = Sandbox.create(timeout=120)
handle = sandbox.commands.run("echo started; sleep 600", background=True)
sandbox.kill()
try:
    handle.wait()
    outcome = {"error": None}
except Exception as exc:
    outcome = {"error": type(exc).__name__, "message": str(exc)}
print(json.dumps(outcome))
"""


def old_sdk_python() -> Path:
    """A venv's python with SDK 2.45 installed, made once and reused (`.installed` marks it whole)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "aenv-e2e"
    target = cache / f"py-{OLD_SDK.replace('==', '-')}"
    if not (target / ".installed").exists():
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(target)], check=True)
        pip = [str(target / "bin" / "pip"), "install", "-q", OLD_SDK]
        result = subprocess.run(pip, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            pytest.fail(f"pip install {OLD_SDK} failed (is PyPI reachable?):\n{result.stderr}")
        (target / ".installed").touch()
    return target / "bin" / "python"


def test_kill_during_a_background_command_sdk_2_45(node: NodeServer) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(E2B_API_URL=node.url, E2B_SANDBOX_URL=node.url, E2B_API_KEY=node.key)
    result = subprocess.run(
        [str(old_sdk_python()), "-c", KILLED_BACKGROUND_COMMAND],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert "killed or reached its end of life" in outcome.get("message", ""), outcome
