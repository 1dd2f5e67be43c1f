"""The node API's latency while a figure loads the node: a separate process asks it every 100 ms.

A separate process, not a task in the harness's event loop: with 256 rollouts at once the
harness's own loop is busy, and a task there would time its wait for that loop (and for a free
connection of the harness's pool) along with the node. Each path gets a kept-alive connection of
its own, as a monitoring probe would hold; the probe stops when its stdin closes and prints the
latencies (ms) per path as JSON.

    AENV_API_KEY=... python -m bench.probe URL PATH [PATH...]
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import sys
import threading
import time
from urllib.parse import urlsplit

from .node import REPO

INTERVAL = 0.1  # seconds between two requests to the same path
TIMEOUT = 30.0


def _probe(url: str, key: str, path: str, stop: threading.Event, latencies: list[float]) -> None:
    """GET `path` every `INTERVAL` until `stop`; a failed request counts as the time it took."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=TIMEOUT)
    while not stop.is_set():
        started = time.perf_counter()
        try:
            connection.request("GET", path, headers={"X-API-Key": key})
            connection.getresponse().read()
        except (OSError, http.client.HTTPException):
            connection.close()  # the next request opens a new connection
        elapsed = time.perf_counter() - started
        latencies.append(round(elapsed * 1000, 2))
        stop.wait(max(0.0, INTERVAL - elapsed))
    connection.close()


def main() -> int:
    url, *paths = sys.argv[1:]
    key = os.environ.get("AENV_API_KEY", "")
    stop = threading.Event()
    latencies: dict[str, list[float]] = {path: [] for path in paths}
    threads = [
        threading.Thread(target=_probe, args=(url, key, path, stop, latencies[path]), daemon=True)
        for path in paths
    ]
    for thread in threads:
        thread.start()
    sys.stdin.read()  # until the harness closes it
    stop.set()
    for thread in threads:
        thread.join(TIMEOUT + 1)
    json.dump(latencies, sys.stdout)
    return 0


class Probe:
    """`async with Probe(url, key, paths) as probe:` ... `probe.latencies[path]` afterwards."""

    def __init__(self, url: str, key: str, paths: tuple[str, ...]):
        self.command = [sys.executable, "-m", "bench.probe", url, *paths]
        self.env = {**os.environ, "AENV_API_KEY": key}  # not on its command line, which `ps` shows
        self.latencies: dict[str, list[float]] = {}
        self._process: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> Probe:
        self._process = await asyncio.create_subprocess_exec(
            *self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            cwd=REPO, env=self.env,
        )  # fmt: skip
        return self

    async def __aexit__(self, *exc: object) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        try:
            if process.stdin is not None:
                process.stdin.close()  # the probe's signal to stop (`communicate` keeps it open)
            output, _ = await asyncio.wait_for(process.communicate(), TIMEOUT + 5)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            raise
        self.latencies = json.loads(output or b"{}")


if __name__ == "__main__":
    raise SystemExit(main())
