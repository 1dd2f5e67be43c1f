"""The host's own calls to a guest's envd: readiness, /init, and commands run as root.

These go through a socket created in the sandbox's namespace with the stdlib HTTP client;
they are few and small, and this keeps the launcher free of any HTTP client dependency.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import json
import time
from collections.abc import Callable
from typing import Any, NamedTuple
from urllib.parse import quote

from ..agent.envd import ENVD_PORT
from ..agent.envd.connect import ENVELOPE_HEADER, FLAG_END_STREAM, envelope, envelope_header
from ..clock import rfc3339
from ..network.netns import GUEST_ADDRESS, SandboxNetwork

INIT_RETRY_INTERVAL = 0.05


def utc_timestamp() -> str:
    """Now, as the RFC 3339 UTC timestamp envd's /init takes (microseconds)."""
    return rfc3339(timespec="microseconds")


class EnvdUnavailable(RuntimeError):
    """envd did not answer in time."""


class SampleBatch(NamedTuple):
    """An answer of envd's `/metrics/history`."""

    samples: list[dict[str, Any]]
    next_in: float | None  # seconds the guest runs before its next sample (None: envd did not say)


class _GuestHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection whose socket is created inside a sandbox's namespace."""

    def __init__(self, network: SandboxNetwork, port: int, timeout: float):
        super().__init__(GUEST_ADDRESS, port, timeout=timeout)
        self._network = network

    def connect(self) -> None:
        sock = self._network.socket()
        sock.setblocking(True)
        sock.settimeout(self.timeout)
        try:
            sock.connect((GUEST_ADDRESS, self.port))
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class EnvdLink:
    """Talks to one guest's envd on behalf of the host.

    Short requests reuse a kept-alive connection: under TCG, envd accepting a new connection
    costs the guest about as much as the request itself (≈10 ms), and `/init` on a warm guest is
    on the path of every create and resume.
    """

    def __init__(self, network: SandboxNetwork, access_token: str | None = None):
        self.network = network
        self.access_token = access_token
        self._idle: list[_GuestHTTPConnection] = []

    def close(self) -> None:
        """Close the kept-alive connections (e.g. before a template's state is saved)."""
        while self._idle:
            with contextlib.suppress(IndexError):
                self._idle.pop().close()

    def _request(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 5.0,
    ) -> tuple[int, bytes]:
        """One request, on a kept-alive connection when there is one that still works.

        envd closes idle connections after a while; a reused one that fails is replaced by a
        fresh one and the request sent again (the requests sent this way are idempotent).
        """
        while self._idle:
            try:
                conn = self._idle.pop()
            except IndexError:  # another thread took the last one
                break
            try:
                conn.sock.settimeout(timeout)
                return self._exchange(conn, method, path, body, headers)
            except TimeoutError:
                conn.close()
                raise
            except (OSError, http.client.HTTPException):
                conn.close()
        conn = _GuestHTTPConnection(self.network, ENVD_PORT, timeout)
        try:
            return self._exchange(conn, method, path, body, headers)
        except BaseException:
            conn.close()
            raise

    def _exchange(
        self,
        conn: _GuestHTTPConnection,
        method: str,
        path: str,
        body: bytes | None,
        headers: dict[str, str] | None,
    ) -> tuple[int, bytes]:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        answer = response.read()
        if response.will_close:
            conn.close()
        else:
            self._idle.append(conn)
        return response.status, answer

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        headers = {"X-Access-Token": self.access_token} if self.access_token else {}
        return headers | (extra or {})

    async def healthy(self, timeout: float = 1.0) -> bool:
        try:
            status, _ = await asyncio.to_thread(self._request, "GET", "/health", timeout=timeout)
        except (OSError, http.client.HTTPException):
            return False
        return 200 <= status < 300

    async def wait_ready(self, timeout: float, *, poll: float = 0.05) -> float:
        """Poll /health until it answers; returns the seconds waited."""
        started = time.monotonic()
        while not await self.healthy(timeout=min(2.0, timeout)):
            if time.monotonic() - started > timeout:
                raise EnvdUnavailable(f"envd did not answer /health within {timeout:.0f} s")
            await asyncio.sleep(poll)
        return time.monotonic() - started

    async def init(self, payload: dict[str, Any], timeout: float = 5.0) -> bytes:
        """POST /init: env vars, access token, default user and workdir, wall clock, entropy.

        Returns envd's answer (empty, but for aenv's own fields such as `volumeMounts`)."""
        headers = self._headers({"Content-Type": "application/json"})
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if "timestamp" in payload:  # the wall clock as of this attempt
                payload = {**payload, "timestamp": utc_timestamp()}
            body = json.dumps(payload).encode()
            try:
                status, answer = await asyncio.to_thread(
                    self._request, "POST", "/init", body=body, headers=headers, timeout=max(left, 0.1)
                )
                break
            except TimeoutError:
                raise
            except OSError:  # unreachable for now: a starved guest can answer ARP too late
                if left < INIT_RETRY_INTERVAL:
                    raise
                await asyncio.sleep(INIT_RETRY_INTERVAL)
        if status >= 300:
            raise RuntimeError(f"envd /init answered {status}: {answer[:200]!r}")
        return answer

    async def metrics_history(self, start: int | None = None, timeout: float = 5.0) -> SampleBatch:
        """The resource samples envd kept since `start` (Unix seconds; None: all), oldest first."""
        path = "/metrics/history" if start is None else f"/metrics/history?start={start}"
        status, body = await asyncio.to_thread(
            self._request, "GET", path, headers=self._headers(), timeout=timeout
        )
        if status != 200:
            raise RuntimeError(f"envd /metrics/history answered {status}: {body[:200]!r}")
        answer = json.loads(body)
        next_in = answer.get("next_in")
        return SampleBatch(answer["samples"], float(next_in) if isinstance(next_in, int | float) else None)

    async def run(
        self,
        cmd: str,
        *,
        user: str = "root",
        envs: dict[str, str] | None = None,
        cwd: str | None = None,
        background: bool = False,
        timeout: float = 30.0,
    ) -> int | None:
        """Run `cmd` with `/bin/bash -l -c` through envd's process.Process/Start.

        Returns the exit code, or None for a background command (it keeps running after the
        call, as envd keeps processes alive when their client goes away).
        """
        return await self.execute(
            ["/bin/bash", "-l", "-c", cmd],
            user=user,
            envs=envs,
            cwd=cwd,
            background=background,
            timeout=timeout,
        )

    async def execute(
        self,
        argv: list[str],
        *,
        user: str = "root",
        envs: dict[str, str] | None = None,
        cwd: str | None = None,
        background: bool = False,
        timeout: float = 30.0,
        on_output: Callable[[bytes], None] | None = None,
    ) -> int | None:
        """Run `argv` as `user`; `on_output` gets its stdout and stderr as they arrive (in a thread)."""
        process: dict[str, Any] = {"cmd": argv[0], "args": argv[1:], "envs": envs or {}}
        if cwd:
            process["cwd"] = cwd
        message = json.dumps({"process": process}).encode()
        headers = self._headers({
            "Content-Type": "application/connect+json",
            "Connect-Protocol-Version": "1",
            "Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode(),
        })  # fmt: skip
        if not background:
            headers["Connect-Timeout-Ms"] = str(int(timeout * 1000))
        return await asyncio.to_thread(self._start, message, headers, background, timeout, on_output)

    async def write_file(self, path: str, data: bytes, *, timeout: float = 300.0) -> None:
        """Write `data` to `path` in the guest as root (envd's octet-stream upload)."""
        headers = self._headers({"Content-Type": "application/octet-stream"})
        status, answer = await asyncio.to_thread(
            self._request, "POST", f"/files?path={quote(path)}&username=root", body=data,
            headers=headers, timeout=timeout,
        )  # fmt: skip
        if status >= 300:
            raise RuntimeError(f"envd /files answered {status}: {answer[:200]!r}")

    def _start(
        self,
        message: bytes,
        headers: dict[str, str],
        background: bool,
        timeout: float,
        on_output: Callable[[bytes], None] | None = None,
    ) -> int | None:
        conn = _GuestHTTPConnection(self.network, ENVD_PORT, timeout)
        try:
            conn.request("POST", "/process.Process/Start", envelope(message), headers)
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"envd Start answered {response.status}: {response.read()[:200]!r}")
            while header := response.read(ENVELOPE_HEADER):
                flags, size = envelope_header(header)
                frame = json.loads(response.read(size) or b"{}")
                if flags & FLAG_END_STREAM:
                    if "error" in frame:
                        raise RuntimeError(f"envd Start failed: {frame['error']}")
                    break
                event = frame.get("event", {})
                if background and "start" in event:
                    return None
                if on_output is not None and "data" in event:
                    for chunk in event["data"].values():
                        on_output(base64.b64decode(chunk))
                if "end" in event:
                    return int(event["end"].get("exitCode", 0))
            raise RuntimeError("envd Start ended without an end event")
        finally:
            conn.close()
