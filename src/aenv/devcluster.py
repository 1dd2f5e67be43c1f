"""A throwaway cluster's processes, for tests, benchmarks and demos: Redis, `aenv scheduler` and
`aenv gateway` (nodes are `aenv.devnode.DevNode`s with `scheduler_url` set).

Each runs on a free loopback port with its files in a directory of the caller's, waits until it
answers, and is stopped by its pid when its block ends (also when the block fails).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

from .devnode import free_port

START_TIMEOUT = 60.0  # seconds for a service to answer after it was started
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # where `import aenv` found this package
# The service gets SIGTERM when the thread that started it ends, even by SIGKILL (see devnode).
_LAUNCH = ["setpriv", "--pdeathsig", "TERM", "--", sys.executable, "-m", "aenv.cli"]


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if the process has not exited within 5 s."""
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def service_env(**settings: object) -> dict[str, str]:
    """The environment of a cluster service of this package: the caller's, less its AENV_ and
    E2B_ variables, plus `settings` as `AENV_<NAME>`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
    env["PYTHONPATH"] = str(_PACKAGE_ROOT)
    env.update({f"AENV_{name.upper()}": str(value) for name, value in settings.items() if value is not None})
    return env


def wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}:\n{log_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code < 300:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not healthy after {START_TIMEOUT:.0f} s:\n{log_tail(log)}")
        time.sleep(0.1)


def log_tail(log: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass(frozen=True)
class RedisServer:
    url: str
    pid: int

    def flush(self) -> None:
        """Empty the database, as a Redis that lost its data would be."""
        with redis.Redis.from_url(self.url) as client:
            client.flushall()


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[RedisServer]:
    """Debian's `redis-server` until the block ends, without persistence; waits until it answers PING."""
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not os.access(binary, os.X_OK):
        raise RuntimeError("redis-server is missing: apt-get install redis-server")
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    args = [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
        "--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", str(workdir / "redis.log"),
    ]  # fmt: skip
    process = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True
    )
    server = RedisServer(f"redis://127.0.0.1:{port}/0", process.pid)
    try:
        _wait_redis(server, process, workdir / "redis.log")
        yield server
    finally:
        stop(process)


def _wait_redis(server: RedisServer, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    with redis.Redis.from_url(server.url, socket_connect_timeout=1) as client:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"redis-server exited: {log_tail(log)}")
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


@contextlib.contextmanager
def scheduler_process(
    redis_url: str, log: Path, secret: str | None = None, **settings: object
) -> Iterator[str]:
    """`aenv scheduler` until the block ends, yielding its URL once `/health` answers 200;
    `settings` become its `AENV_<NAME>` variables. It must exit cleanly on SIGTERM."""
    port = free_port()
    env = service_env(
        scheduler_addr=f"127.0.0.1:{port}", redis_url=redis_url, cluster_secret=secret, **settings
    )
    with log.open("ab") as sink:
        process = subprocess.Popen([*_LAUNCH, "scheduler"], env=env, stderr=sink, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, log, "aenv scheduler")
        yield url
    finally:
        stop(process)
    if process.returncode != 0:
        raise RuntimeError(f"aenv scheduler exited with {process.returncode}:\n{log_tail(log)}")


@dataclass
class GatewayProcess:
    """`aenv gateway` as a subprocess on `port`, with `settings` as its `AENV_<NAME>` variables
    (api_key, cluster_secret, scheduler_url), its log in `log_path`."""

    settings: dict[str, object]
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def on_free_port(cls, log_path: Path, **settings: object) -> GatewayProcess:
        return cls(settings, free_port(), log_path)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def key(self) -> str:
        return str(self.settings.get("api_key", ""))

    def start(self) -> None:
        env = service_env(**self.settings, gateway_addr=f"127.0.0.1:{self.port}", log_level="INFO")
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [*_LAUNCH, "gateway"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_healthy(self.url, self.proc, self.log_path, f"aenv gateway on {self.url}")

    def log_tail(self) -> str:
        return log_tail(self.log_path)

    def sigkill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.sigkill()

    def __enter__(self) -> GatewayProcess:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
