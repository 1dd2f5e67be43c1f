"""A throwaway cluster's processes, for tests, benchmarks and demos: Redis, `aenv scheduler` and
`aenv gateway` (nodes are `aenv.devnode.DevNode`s with `scheduler_url` set).

Each runs on a free loopback port with its files in a directory of the caller's, is ready once
it answers, and is stopped by its pid (also when the block that started it fails); a scheduler
or gateway can be crashed and started again on the same port.
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
    return env | {"PYTHONPATH": str(_PACKAGE_ROOT)} | _settings(**settings)


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


@dataclass
class RedisServer:
    """Debian's `redis-server` on a loopback port, its files in `workdir`; with `aof` ("always" or
    "everysec", the `appendfsync` policy) its writes go to an append-only file, which a restart
    reads back. Restartable on the same port after a crash."""

    workdir: Path
    port: int
    aof: str | None = None
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self) -> None:
        """Start (again), and wait until it answers PING (with its append-only file read back)."""
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not os.access(binary, os.X_OK):
            raise RuntimeError("redis-server is missing: apt-get install redis-server")
        self.workdir.mkdir(parents=True, exist_ok=True)
        aof = ["--appendonly", "yes", "--appendfsync", self.aof] if self.aof else ["--appendonly", "no"]
        # Ended with the process that started it, even one killed before its cleanup ran.
        args = [
            "setpriv", "--pdeathsig", "TERM", "--",
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
            "--save", "", *aof, "--daemonize", "no", "--logfile", str(self.workdir / "redis.log"),
        ]  # fmt: skip
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True
        )
        _wait_redis(self.url, self.process, self.workdir / "redis.log")

    def sigkill(self) -> None:
        """Crash it: whatever it had not written to its append-only file is lost."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)

    def flush(self) -> None:
        """Empty the database, as a Redis that lost its data would be."""
        with redis.Redis.from_url(self.url) as client:
            client.flushall()


@contextlib.contextmanager
def redis_server(workdir: Path, aof: str | None = None) -> Iterator[RedisServer]:
    """A `RedisServer` on a free port until the block ends (without persistence unless `aof`)."""
    server = RedisServer(workdir, free_port(), aof)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def _wait_redis(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    with redis.Redis.from_url(url, socket_connect_timeout=1) as client:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"redis-server exited: {log_tail(log)}")
            try:
                if client.ping():
                    return
            except (redis.ConnectionError, redis.BusyLoadingError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


@dataclass
class ClusterProcess:
    """`aenv <command>` (scheduler or gateway) on `port` with `env` on top of this host's
    settings, its output appended to `log_path`; restartable on the same port after a crash, as
    an operator's supervisor would restart it. `key` is the API key a gateway takes."""

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
        env = service_env(log_level="INFO") | self.env
        with self.log_path.open("ab") as log:
            log.write(f"\n==== aenv {self.command} starts ====\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [*_LAUNCH, self.command],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_healthy(self.url, self.proc, self.log_path, f"aenv {self.command}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def sigkill(self) -> None:
        """Crash it: no chance to finish anything."""
        if self.proc is not None and self.alive():
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

    def __enter__(self) -> ClusterProcess:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _settings(**settings: object) -> dict[str, str]:
    return {f"AENV_{name.upper()}": str(value) for name, value in settings.items() if value is not None}


def scheduler(
    redis_url: str, log_path: Path, secret: str | None = None, **settings: object
) -> ClusterProcess:
    """`aenv scheduler` on a free port with the given Redis (not started); `settings` are more of
    its `AENV_<NAME>` variables (`node_down_after=4`)."""
    port = free_port()
    env = _settings(
        scheduler_addr=f"127.0.0.1:{port}", redis_url=redis_url, cluster_secret=secret, **settings
    )
    return ClusterProcess("scheduler", env, port, log_path)


def gateway(scheduler_url: str, log_path: Path, secret: str, key: str) -> ClusterProcess:
    """`aenv gateway` on a free port in front of the scheduler, or schedulers (comma-separated;
    not started)."""
    port = free_port()
    env = _settings(
        gateway_addr=f"127.0.0.1:{port}", api_key=key, cluster_secret=secret, scheduler_url=scheduler_url
    )
    return ClusterProcess("gateway", env, port, log_path, key)


@contextlib.contextmanager
def scheduler_process(
    redis_url: str, log: Path, secret: str | None = None, **settings: object
) -> Iterator[str]:
    """`aenv scheduler` until the block ends, yielding its URL once `/health` answers. It must exit
    cleanly on SIGTERM, or the block fails."""
    process = scheduler(redis_url, log, secret, **settings)
    try:
        process.start()
        yield process.url
    finally:
        code = process.stop()
    if code != 0:
        raise RuntimeError(f"aenv scheduler exited with {code}:\n{process.log_tail()}")
