"""A real `aenv server` for the CLI tests, and a helper that runs the CLI as users do: a subprocess.

The server (`aenv.devnode`) is started once per session in a temporary home seeded with the
session's `base` template, with a fixed API key on a free loopback port. Teardown stops it by
its PID (SIGTERM, which pauses what still runs; SIGKILL if it does not exit) and removes what
it left running.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from aenv.devnode import DevNode, DevNodeError

API_KEY = "e2b_" + "c1" * 16
SLOT_FIRST = 4096  # network slots apart from the other nodes the suite runs (e2e: 8192, bench: 12288)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, template_seed: Path) -> Iterator[DevNode]:
    node = DevNode(
        tmp_path_factory.mktemp("aenv-cli-node"), slot_first=SLOT_FIRST, seed=template_seed,
        api_key=API_KEY, warm_pool_size=1,
    )  # fmt: skip
    try:
        node.start()
    except DevNodeError as exc:
        node.cleanup()
        pytest.fail(str(exc))
    yield node
    if forced := node.cleanup():
        print(f"\naenv CLI tests' node cleaned up by force: {', '.join(forced)}", file=sys.stderr)


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str
    raw: bytes

    def json(self) -> Any:
        return json.loads(self.stdout)


class CLI:
    """Runs `python -m aenv.cli` with the server's URL and key in the environment and a private HOME."""

    def __init__(self, server: DevNode, home: Path) -> None:
        self.home = home
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home),
            "AENV_URL": server.url,
            "AENV_API_KEY": API_KEY,
            "LANG": "C.UTF-8",
        }

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "aenv.cli", *args]

    def run(
        self, *args: str, input: bytes | None = None, env: dict[str, str] | None = None,
        timeout: float = 300, cwd: Path | None = None,
    ) -> Result:  # fmt: skip
        done = subprocess.run(
            self.command(*args), input=input if input is not None else b"", capture_output=True,
            env=self.env | (env or {}), timeout=timeout, cwd=cwd or self.home,
        )  # fmt: skip
        stdout = done.stdout.decode(errors="replace")
        return Result(done.returncode, stdout, done.stderr.decode(errors="replace"), done.stdout)

    def ok(self, *args: str, **kwargs: Any) -> Result:
        result = self.run(*args, **kwargs)
        assert result.code == 0, f"aenv {' '.join(args)} -> {result.code}: {result.stderr}"
        return result


@pytest.fixture(scope="session")
def cli(server: DevNode, tmp_path_factory: pytest.TempPathFactory) -> CLI:
    return CLI(server, tmp_path_factory.mktemp("cli-home"))


@pytest.fixture
def sandbox(cli: CLI) -> Iterator[str]:
    """A running sandbox from `base`, deleted afterwards (if the test did not)."""
    sandbox_id = cli.ok("start", "base", "--detach", "--metadata", "suite=cli").stdout.strip()
    yield sandbox_id
    cli.run("delete", sandbox_id)
