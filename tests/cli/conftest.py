"""A real `aenv server` for the CLI tests, and a helper that runs the CLI as users do: a subprocess.

The server is started once per session in a temporary home with a fixed API key on a free loopback
port (the first start builds the base template: ~15-30 s under TCG). It is stopped by its PID:
SIGTERM (which pauses what still runs), SIGKILL if it does not exit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

API_KEY = "e2b_" + "c1" * 16
START_WITHIN_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("aenv-cli-node")
    port = free_port()
    env = os.environ | {
        "AENV_HOME_PATH": str(home),
        "AENV_API_KEY": API_KEY,
        "AENV_API_ADDR": f"127.0.0.1:{port}",
        "AENV_WARM_POOL_SIZE": "1",
        "AENV_SLOT_FIRST": "4096",  # network slots apart from other nodes the suite runs
    }
    log = home / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "aenv.cli", "server"], env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    server = Server(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + START_WITHIN_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"aenv server exited with {process.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 204:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"aenv server not healthy within {START_WITHIN_S}s:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)
        yield server
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)


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

    def __init__(self, server: Server, home: Path) -> None:
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
def cli(server: Server, tmp_path_factory: pytest.TempPathFactory) -> CLI:
    return CLI(server, tmp_path_factory.mktemp("cli-home"))


@pytest.fixture
def sandbox(cli: CLI) -> Iterator[str]:
    """A running sandbox from `base`, deleted afterwards (if the test did not)."""
    sandbox_id = cli.ok("start", "base", "--detach", "--metadata", "suite=cli").stdout.strip()
    yield sandbox_id
    cli.run("delete", sandbox_id)
