"""The cluster's services as real processes for tests: `aenv scheduler` and `aenv gateway` on
ports of their own, stopped by their pids, and restartable on the same port after a SIGKILL, as
an operator's supervisor would restart them (nodes and gateways keep the scheduler's URL).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.storage.seaweed import free_port

SRC = Path(__file__).parents[2] / "src"
# The service gets SIGTERM when the thread that started it ends, even by SIGKILL (see aenv.devnode).
_LAUNCH = ["setpriv", "--pdeathsig", "TERM", "--", sys.executable, "-m", "aenv.cli"]
START_TIMEOUT = 60.0


@dataclass
class ClusterProcess:
    """`aenv <command>` (scheduler or gateway) with `env` on top of this host's settings; its
    output is appended to `log_path`. `key` is the API key a gateway takes."""

    command: str
    env: dict[str, str]
    port: int
    log_path: Path
    key: str = ""
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def domain(self) -> str:
        """Sandbox hosts a gateway hands out are `{port}-{id}.{domain}`."""
        return f"localhost:{self.port}"

    def start(self) -> None:
        """Start (again) and wait until `/health` answers."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
        env.update(self.env, PYTHONPATH=str(SRC), AENV_LOG_LEVEL="INFO")
        with self.log_path.open("ab") as log:
            log.write(f"\n==== aenv {self.command} starts ====\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [*_LAUNCH, self.command], env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT
        while not self._healthy():
            assert time.monotonic() < deadline, f"aenv {self.command} not healthy:\n{self.log_tail()}"
            time.sleep(0.1)

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"aenv {self.command} exited:\n{self.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(self.url + "/health", timeout=2).status_code < 300
        return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def sigkill(self) -> None:
        """Crash it: no chance to finish anything."""
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 30 s; its exit code (None if it was never started)."""
        if self.proc is None:
            return None
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.sigkill()
        return self.proc.returncode


def scheduler(redis_url: str, log_path: Path, secret: str | None = None, **settings: str) -> ClusterProcess:
    """`aenv scheduler` on a free port with the given Redis (not started); `settings` are more
    of its `AENV_*` variables (`NODE_DOWN_AFTER="4"`)."""
    port = free_port()
    env = {"AENV_SCHEDULER_ADDR": f"127.0.0.1:{port}", "AENV_REDIS_URL": redis_url}
    env |= {f"AENV_{name.upper()}": value for name, value in settings.items()}
    if secret:
        env["AENV_CLUSTER_SECRET"] = secret
    return ClusterProcess("scheduler", env, port, log_path)


def gateway(scheduler_url: str, log_path: Path, secret: str, key: str) -> ClusterProcess:
    """`aenv gateway` on a free port in front of the scheduler (not started)."""
    port = free_port()
    env = {"AENV_GATEWAY_ADDR": f"127.0.0.1:{port}", "AENV_API_KEY": key, "AENV_CLUSTER_SECRET": secret,
           "AENV_SCHEDULER_URL": scheduler_url}  # fmt: skip
    return ClusterProcess("gateway", env, port, log_path, key)


@contextlib.contextmanager
def scheduler_process(redis_url: str, log: Path, secret: str | None = None) -> Iterator[str]:
    """Run `aenv scheduler` until the block ends, yielding its URL once `/health` answers.
    It exits cleanly on SIGTERM, or the block fails."""
    process = scheduler(redis_url, log, secret)
    try:
        process.start()
        yield process.url
    finally:
        code = process.stop()
    assert code == 0, process.log_tail()
