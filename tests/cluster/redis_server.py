"""A real Redis for tests: Debian's `redis-server` on a free loopback port, its files in a
temporary directory, stopped by its pid (also when the test fails).

Importable by any test package (`from tests.cluster.redis_server import redis_server`), as the
gateway's tests use the same cluster state.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis

from tests.storage.seaweed import free_port, stop


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
    """`redis-server` until the block ends; waits until it answers PING."""
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
        _wait_ready(server, process, workdir / "redis.log")
        yield server
    finally:
        stop(process)


def _wait_ready(server: RedisServer, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 30
    client = redis.Redis.from_url(server.url, socket_connect_timeout=1)
    with client:
        while True:
            if process.poll() is not None:
                text = log.read_text(errors="replace") if log.exists() else ""
                raise RuntimeError(f"redis-server exited: {text[-2000:]}")
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
