"""`aenv scheduler` as a real process for tests: its own port, the given Redis, stopped by its pid."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.storage.seaweed import free_port, stop

SRC = Path(__file__).parents[2] / "src"


@contextlib.contextmanager
def scheduler_process(redis_url: str, log: Path, secret: str | None = None) -> Iterator[str]:
    """Run `aenv scheduler` until the block ends, yielding its URL once `/health` answers 200.
    Exits cleanly on SIGTERM, or the block fails."""
    port = free_port()
    env = {**os.environ, "AENV_SCHEDULER_ADDR": f"127.0.0.1:{port}", "AENV_REDIS_URL": redis_url,
           "PYTHONPATH": str(SRC)}  # fmt: skip
    env.pop("AENV_CLUSTER_SECRET", None)
    if secret:
        env["AENV_CLUSTER_SECRET"] = secret
    with log.open("wb") as sink:
        process = subprocess.Popen([sys.executable, "-m", "aenv.cli", "scheduler"], env=env, stderr=sink)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        yield url
    finally:
        stop(process)
    assert process.returncode == 0, log.read_text()
