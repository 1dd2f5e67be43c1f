"""The host's own calls to a guest's envd: readiness, /init, and commands run as root.

These go through a socket created in the sandbox's namespace, spoken to with h11 (HTTP/1.1 as
a state machine, no I/O of its own): they are few and small, and several are on the path of a
user's call.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import posixpath
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote

import aiohttp
import h11

from ..agent.envd import ENVD_PORT
from ..agent.envd.framing import FLAG_END_STREAM, MessageTooLarge, envelope, envelopes
from ..clock import rfc3339
from ..network.netns import GUEST_ADDRESS, SandboxNetwork

INIT_RETRY_INTERVAL = 0.05
READ_SIZE = 64 * 1024
STREAM_CHUNK = 1 << 20
# What the node reads from a guest is bounded in size per call: the guest's root can replace
# envd with anything on its port, and a node that read a 1.5 GiB chunked answer whole went from
# 114 MiB to 4.7 GiB (bounded: 102 to 105 MiB through endless answers to metrics, a pause and a
# resume, tests/e2e/test_rogue_guest.py). Each bound is several times the largest real answer.
# /health, /init (empty, or aenv's `volumeMounts`: a few hundred bytes a mount), /files and the
# error bodies of any call: a few KiB at most.
SMALL_ANSWER_BYTES = 64 * 1024
# /metrics/history: its widest real answer (720 samples, an hour at envd's 5 s interval, every
# number at its widest) is 174 KiB of JSON.
HISTORY_ANSWER_BYTES = 1024 * 1024
# One Connect envelope of a command's output stream (the stream itself is handed on as it
# arrives, never kept): envd reads 32 KiB of output at a time, 44 KiB once in base64 and JSON.
STREAM_FRAME_BYTES = 1024 * 1024
# The numbers of an envd metrics sample the node keeps (`aenv.agent.envd.metrics.render`).
SAMPLE_FIELDS = ("cpu_count", "cpu_used_pct", "mem_total", "mem_used", "mem_cache", "disk_used", "disk_total")
# Seconds a command's stream may outlast its timeout: envd ends the command at the timeout, and
# its last frames still have to reach the node from a guest that may be starved under TCG.
STREAM_GRACE = 10.0


def utc_timestamp() -> str:
    """Now, as the RFC 3339 UTC timestamp envd's /init takes (microseconds)."""
    return rfc3339(timespec="microseconds")


class EnvdUnavailable(RuntimeError):
    """envd did not answer in time."""


class GuestAnswerError(Exception):
    """The guest broke a bound the node holds its answers to; `code` names which. Only its own
    sandbox's call fails (`aenv.orchestrator.errors.BadGuest`)."""

    code = "guest_answer_invalid"


class AnswerInvalid(GuestAnswerError, RuntimeError):
    """The guest's answer is not the HTTP or Connect an envd speaks."""


class AnswerTooLarge(GuestAnswerError, RuntimeError):
    """The guest's answer was larger than any a real envd gives to that call."""

    code = "guest_answer_too_large"


class AnswerTooSlow(GuestAnswerError, TimeoutError):
    """The guest started answering but had not finished when the call's deadline came (one that
    trickles bytes forever). A guest that sent nothing at all is a plain `TimeoutError`: a
    starved guest does that, and the same call succeeds once the node has room."""

    code = "guest_answer_too_slow"


def _sample(raw: Any) -> dict[str, Any] | None:
    """A sample of envd's as the node keeps it: its time and its numbers, nothing else (the
    samples are saved with the sandbox and merged at every pause, so whatever else a hostile
    guest put in them would pile up there)."""
    if not isinstance(raw, dict) or type(raw.get("ts")) is not int:
        return None
    return {"ts": raw["ts"]} | {
        name: value for name in SAMPLE_FIELDS if isinstance(value := raw.get(name), int | float)
    }


class SampleBatch(NamedTuple):
    """An answer of envd's `/metrics/history`."""

    samples: list[dict[str, Any]]
    next_in: float | None  # seconds the guest runs before its next sample (None: envd did not say)


class _Connection:
    """One HTTP/1.1 connection to envd, made inside the sandbox's namespace: h11's state machine
    over asyncio streams. Every wait on the guest (connecting, sending, each read) is bounded by
    `timeout`, as a socket timeout would be. It belongs to the event loop that opened it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float):
        self.reader = reader
        self.writer = writer
        self.timeout = timeout
        self.http = h11.Connection(h11.CLIENT)
        self.received = 0  # bytes of the guest's answer so far (an answer begun is not a starved guest)

    @classmethod
    async def open(cls, network: SandboxNetwork, timeout: float) -> _Connection:
        sock = network.socket()
        try:
            async with asyncio.timeout(timeout):
                await asyncio.get_running_loop().sock_connect(sock, (GUEST_ADDRESS, ENVD_PORT))
            reader, writer = await asyncio.open_connection(sock=sock)
        except BaseException:
            sock.close()
            raise
        return cls(reader, writer, timeout)

    async def send(self, method: str, path: str, headers: dict[str, str], body: bytes) -> None:
        self.received = 0
        fields = [("Host", GUEST_ADDRESS), ("Content-Length", str(len(body))), *headers.items()]
        request = h11.Request(method=method, target=path, headers=fields)
        # One write: with TCP_NODELAY, each would be a packet of its own, and under TCG each
        # packet costs the guest an interrupt.
        events = (request, h11.Data(data=body), h11.EndOfMessage())
        self.writer.writelines(
            [data for event in events for data in self.http.send_with_data_passthrough(event) or []]
        )
        async with asyncio.timeout(self.timeout):
            await self.writer.drain()

    async def stream(self, path: str, headers: dict[str, str], head: bytes, source: Path) -> None:
        """POST ``head`` then the file's bytes as they are read from disk, never all at once."""
        fields = [("Host", GUEST_ADDRESS), ("Content-Length", str(len(head) + source.stat().st_size))]
        request = h11.Request(method="POST", target=path, headers=[*fields, *headers.items()])
        self.writer.writelines([self.http.send(request) or b"", self.http.send(h11.Data(data=head)) or b""])
        with source.open("rb") as file:
            while chunk := await asyncio.to_thread(file.read, STREAM_CHUNK):
                self.writer.write(self.http.send(h11.Data(data=chunk)) or b"")
                async with asyncio.timeout(self.timeout):
                    await self.writer.drain()
        self.writer.write(self.http.send(h11.EndOfMessage()) or b"")
        async with asyncio.timeout(self.timeout):
            await self.writer.drain()

    async def response(self) -> h11.Response:
        event = await self._event()
        if not isinstance(event, h11.Response):
            raise h11.RemoteProtocolError(f"expected a response from envd, got {event!r}")
        return event

    async def chunks(self) -> AsyncIterator[bytes]:
        """The response's body, as it arrives."""
        while isinstance(event := await self._event(), h11.Data):
            yield bytes(event.data)

    async def body(self, limit: int) -> bytes:
        """The response's whole body, at most `limit` bytes (else `AnswerTooLarge`)."""
        chunks, size = [], 0
        async for chunk in self.chunks():
            size += len(chunk)
            if size > limit:
                raise AnswerTooLarge(f"envd answered more than the {limit} bytes expected")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _event(self) -> h11.Event | type[h11.PAUSED]:
        """The next event; a connection envd closed before answering whole is a
        `ConnectionResetError`, as a socket's would be (and a kept-alive one is replaced)."""
        try:
            while (event := self.http.next_event()) is h11.NEED_DATA:
                async with asyncio.timeout(self.timeout):
                    data = await self.reader.read(READ_SIZE)  # b"": closed
                self.received += len(data)
                self.http.receive_data(data)
        except h11.RemoteProtocolError as exc:
            if self.reader.at_eof():
                raise ConnectionResetError(f"envd closed the connection: {exc}") from exc
            raise
        return event

    def reusable(self) -> bool:
        """Whether the exchange ended cleanly with the connection kept alive; then it is ready
        for the next request."""
        if self.http.our_state is h11.DONE and self.http.their_state is h11.DONE:
            self.http.start_next_cycle()
            return True
        return False

    def close(self) -> None:
        self.writer.close()


class EnvdLink:
    """Talks to one guest's envd on behalf of the host.

    Short requests reuse a kept-alive connection: under TCG, envd accepting a new connection
    costs the guest about as much as the request itself (≈10 ms), and `/init` on a warm guest is
    on the path of every create and resume. Requests run on the caller's event loop, without a
    thread: handing each to one and parsing with `http.client` cost the host about 0.5 ms more.
    """

    def __init__(self, network: SandboxNetwork, access_token: str | None = None):
        self.network = network
        self.access_token = access_token
        self._idle: list[_Connection] = []

    def close(self) -> None:
        """Close the kept-alive connections (e.g. before a template's state is saved)."""
        while self._idle:
            self._idle.pop().close()

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        timeout: float = 5.0,
        limit: int = SMALL_ANSWER_BYTES,
    ) -> tuple[int, bytes]:
        """One request, on a kept-alive connection when there is one that still works; the whole
        call ends within `timeout` and reads at most `limit` bytes of body.

        envd closes idle connections after a while; a reused one that fails is replaced by a
        fresh one and the request sent again (the requests sent this way are idempotent).
        """
        deadline = asyncio.get_running_loop().time() + timeout
        while self._idle:
            conn = self._idle.pop()
            conn.timeout = timeout
            try:
                return await self._exchange(conn, deadline, method, path, body, headers, limit)
            except BaseException as exc:
                conn.close()
                if isinstance(exc, TimeoutError) or not isinstance(exc, OSError | h11.ProtocolError):
                    raise
        async with asyncio.timeout_at(deadline):
            conn = await _Connection.open(self.network, timeout)
        try:
            return await self._exchange(conn, deadline, method, path, body, headers, limit)
        except BaseException as exc:
            conn.close()
            if isinstance(exc, h11.ProtocolError):
                raise AnswerInvalid(f"envd's answer to {method} {path} is not HTTP: {exc}") from exc
            raise

    async def _exchange(
        self,
        conn: _Connection,
        deadline: float,
        method: str,
        path: str,
        body: bytes,
        headers: dict[str, str] | None,
        limit: int,
    ) -> tuple[int, bytes]:
        async with _answer_by(deadline, conn):
            await conn.send(method, path, headers or {}, body)
            response = await conn.response()
            answer = await conn.body(limit)
        if conn.reusable():
            self._idle.append(conn)
        else:
            conn.close()
        return response.status_code, answer

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        headers = {"X-Access-Token": self.access_token} if self.access_token else {}
        return headers | (extra or {})

    async def healthy(self, timeout: float = 1.0) -> bool:
        try:
            status, _ = await self._request("GET", "/health", timeout=timeout)
        except (OSError, h11.ProtocolError, GuestAnswerError):
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
                status, answer = await self._request(
                    "POST", "/init", body=body, headers=headers, timeout=max(left, 0.1)
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
        status, body = await self._request(
            "GET", path, headers=self._headers(), timeout=timeout, limit=HISTORY_ANSWER_BYTES
        )
        if status != 200:
            raise RuntimeError(f"envd /metrics/history answered {status}: {body[:200]!r}")
        answer = json.loads(body)
        if not isinstance(answer, dict) or not isinstance(samples := answer.get("samples"), list):
            raise AnswerInvalid(f"envd /metrics/history answered no samples: {body[:200]!r}")
        next_in = answer.get("next_in")
        kept = [sample for raw in samples if (sample := _sample(raw)) is not None]
        return SampleBatch(kept, float(next_in) if isinstance(next_in, int | float) else None)

    async def run(
        self,
        cmd: str,
        *,
        user: str | None = "root",
        envs: dict[str, str] | None = None,
        cwd: str | None = None,
        background: bool = False,
        timeout: float = 30.0,
    ) -> int | None:
        """Run `cmd` with `/bin/bash -l -c` through envd's process.Process/Start, as `user`
        (None: envd's default user).

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
        user: str | None = "root",
        envs: dict[str, str] | None = None,
        cwd: str | None = None,
        background: bool = False,
        timeout: float = 30.0,
        on_output: Callable[[bytes], None] | None = None,
    ) -> int | None:
        """Run `argv` as `user` (None: envd's default user); `on_output` gets its stdout and
        stderr as they arrive (called on the event loop, so it must not block)."""
        process: dict[str, Any] = {"cmd": argv[0], "args": argv[1:], "envs": envs or {}}
        if cwd:
            process["cwd"] = cwd
        message = json.dumps({"process": process}).encode()
        headers = self._headers({"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"})
        if user is not None:
            headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:".encode()).decode()
        if not background:
            headers["Connect-Timeout-Ms"] = str(int(timeout * 1000))
        return await self._start(message, headers, background, timeout, on_output)

    async def write_file(
        self, path: str, data: bytes, *, user: str | None = "root", form: bool = False, timeout: float = 300.0
    ) -> None:
        """Write `data` to `path` in the guest as `user` (None: envd's default user): as the body
        of envd's octet-stream upload, or (`form`) as the multipart form E2B's SDKs upload."""
        content_type = "application/octet-stream"
        if form:
            with aiohttp.MultipartWriter("form-data") as multipart:
                part = multipart.append(data, {"Content-Type": content_type})
                part.set_content_disposition("form-data", name="file", filename=posixpath.basename(path))
            data, content_type = await multipart.as_bytes(), multipart.headers["Content-Type"]
        headers = self._headers({"Content-Type": content_type})
        target = f"/files?path={quote(path)}" + (f"&username={quote(user)}" if user is not None else "")
        status, answer = await self._request("POST", target, body=data, headers=headers, timeout=timeout)
        if status >= 300:
            raise RuntimeError(f"envd /files answered {status}: {answer[:200]!r}")

    async def post_json(
        self, path: str, payload: dict[str, Any], *, timeout: float = 60.0
    ) -> tuple[int, bytes]:
        """POST a JSON body (the template runner's calls to envd's build routes)."""
        headers = self._headers({"Content-Type": "application/json"})
        body = json.dumps(payload).encode()
        return await self._request("POST", path, body=body, headers=headers, timeout=timeout)

    async def post_file(self, path: str, head: bytes, source: Path, *, timeout: float) -> tuple[int, bytes]:
        """POST ``head`` and then ``source``, read from disk as it is sent, on a connection of its
        own: a template's COPY upload (up to 512 MiB) is never held in the node's memory."""
        conn = await _Connection.open(self.network, timeout)
        try:
            await conn.stream(path, self._headers({"Content-Type": "application/octet-stream"}), head, source)
            response = await conn.response()
            return response.status_code, await conn.body(SMALL_ANSWER_BYTES)
        finally:
            conn.close()

    async def _start(
        self,
        message: bytes,
        headers: dict[str, str],
        background: bool,
        timeout: float,
        on_output: Callable[[bytes], None] | None = None,
    ) -> int | None:
        """The command's stream, handed on as it arrives; it ends within `timeout` and
        `STREAM_GRACE` (envd itself ends a foreground command at `timeout`)."""
        deadline = asyncio.get_running_loop().time() + timeout + STREAM_GRACE
        async with asyncio.timeout_at(deadline):
            conn = await _Connection.open(self.network, timeout)
        try:
            async with _answer_by(deadline, conn):
                await conn.send("POST", "/process.Process/Start", headers, envelope(message))
                return await _command_result(conn, background, on_output)
        except h11.ProtocolError as exc:
            raise AnswerInvalid(f"envd's answer to Start is not HTTP: {exc}") from exc
        except MessageTooLarge as exc:
            raise AnswerTooLarge(f"envd's Start stream: {exc}") from exc
        finally:
            conn.close()


async def _command_result(
    conn: _Connection, background: bool, on_output: Callable[[bytes], None] | None
) -> int | None:
    """Read envd's answer to process.Process/Start up to the command's end (or, `background`,
    its start); its output goes to `on_output`."""
    response = await conn.response()
    if response.status_code != 200:
        answer = await conn.body(SMALL_ANSWER_BYTES)
        raise RuntimeError(f"envd Start answered {response.status_code}: {answer[:200]!r}")
    async for flags, frame in envelopes(conn.chunks(), STREAM_FRAME_BYTES):
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


@contextlib.asynccontextmanager
async def _answer_by(deadline: float, conn: _Connection) -> AsyncIterator[None]:
    """Everything inside ends by `deadline` (event loop time): a guest that answers, but too
    slowly to finish by then, gets `AnswerTooSlow`; one that sent nothing, a plain `TimeoutError`."""
    try:
        async with asyncio.timeout_at(deadline):
            yield
    except TimeoutError as exc:
        if conn.received:
            raise AnswerTooSlow(
                f"envd was still answering after the call's deadline ({conn.received} bytes)"
            ) from exc
        raise
