"""Fixtures running envd as a host subprocess and pointing the official e2b SDK at it (no control plane).

`test_sdk.py` only uses the `sandbox` and `workdir` fixtures, so the same module can run against envd inside
a real VM by overriding those two fixtures."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from aenv.agent.envd import ENVD_VERSION
from aenv.guest.tools import build_exec_helper

SRC = Path(__file__).resolve().parents[2] / "src"


@dataclass
class EnvdProcess:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    token: str | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def run_envd(
    tmp: Path,
    token: str | None = None,
    env_vars: dict[str, str] | None = None,
    state_file: Path | None = None,
    host_peer: str | None = None,
) -> Iterator[EnvdProcess]:
    """Start envd on a free loopback port, wait for /health, optionally /init it; always stop it."""
    port = free_port()
    workdir = tmp / "default-workdir"
    workdir.mkdir(parents=True, exist_ok=True)
    log = tmp / f"envd-{port}.log"
    helper = tmp / f"aenv-exec-{port}"
    build_exec_helper(helper)  # as the tools drive carries it
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    quiet_rc = tmp / "empty-bashrc"
    quiet_rc.touch()
    with log.open("wb") as logf:
        proc = subprocess.Popen(
            [
                # The SDK's commands are login shells (`bash -l`), here run as root on this host,
                # whose own ~/.bashrc is not the sandbox's and may run anything: on these hosts
                # `pyenv rehash`, whose lock a test that kills its command can leave behind, and
                # every later login shell then waits a minute for it. So envd runs in a mount
                # namespace of its own, where root's ~/.bashrc is empty.
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                'mount --bind "$0" /root/.bashrc 2>/dev/null; exec "$@"',
                str(quiet_rc),
                sys.executable,
                "-m",
                "aenv.agent.envd",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--default-user",
                "root",
                "--default-workdir",
                str(workdir),
                *(["--state-file", str(state_file)] if state_file else []),
                *(["--host-peer", host_peer] if host_peer else []),
                "--exec-helper",
                str(helper),
            ],
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 15
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"envd exited early:\n{log.read_text()}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 204:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"envd did not become healthy:\n{log.read_text()}")
            time.sleep(0.05)
        if token or env_vars:
            body = {"accessToken": token, "envVars": env_vars or {}}
            r = httpx.post(url + "/init", json={k: v for k, v in body.items() if v})
            assert r.status_code == 204, r.text
        yield EnvdProcess(url, proc, log, token)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def sdk_sandbox(envd: EnvdProcess, token: str | None = None):
    """An SDK `Sandbox` bound directly to envd, as the control plane would hand it out."""
    from e2b import Sandbox
    from e2b.connection_config import ConnectionConfig
    from packaging.version import Version

    token = token if token is not None else envd.token
    headers = {"E2b-Sandbox-Id": "envdtest", "E2b-Sandbox-Port": "49983"}
    if token:
        headers["X-Access-Token"] = token
    config = ConnectionConfig(debug=True, sandbox_url=envd.url, extra_sandbox_headers=headers)
    return Sandbox(
        sandbox_id="envdtest",
        sandbox_domain=None,
        envd_version=Version(ENVD_VERSION),
        envd_access_token=token,
        traffic_access_token=None,
        connection_config=config,
    )


@pytest.fixture(scope="session")
def envd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvdProcess]:
    with run_envd(
        tmp_path_factory.mktemp("envd"), token=uuid.uuid4().hex, env_vars={"AENV_SANDBOX_VAR": "from-init"}
    ) as envd:
        yield envd


@pytest.fixture(scope="session")
def sandbox(envd_server: EnvdProcess):
    return sdk_sandbox(envd_server)


@pytest.fixture
def workdir(tmp_path: Path) -> str:
    """An absolute directory inside the sandbox that the test may freely use."""
    path = tmp_path / "work"
    path.mkdir()
    return str(path)
