"""The node's own `POST /init`, answered before aiohttp's request machinery sees the connection.

Under TCG every restored guest (a fork's child, a resume after the parked process was released,
a warm VM) runs in a new QEMU process that translates guest code afresh, and the node's `/init`
is the first request it answers: the cost of that request's code path is on the path of the
node's answer, and most of it is aiohttp's (its parser, header maps, request, middleware and
response objects: thousands of translation blocks, ~0.1 s of emulated CPU). The node's request
needs none of it. This protocol sits in front of aiohttp on envd's port: a connection from the
host peer that starts with a well-formed `POST /init` with a `Content-Length` is answered here,
with the same checks and effects as the HTTP route (`system_api.parse_init`). Anything else — a
connection from elsewhere, another request, a body `parse_init` refuses, chunked encoding — is
handed to aiohttp as it arrived, with the bytes read so far, so every other behaviour (and every
error answer) is aiohttp's.

The node's other request on the path of a user's call, `GET /metrics/history` (the samples it
keeps before a pause stops the guest), is answered here too when it carries the access token:
a pause waits for it, and under TCG answering it here rather than through aiohttp took it from
5-11 ms to 4-5 ms (the guest's stop and device-state save take about 4 ms).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import cast
from urllib.parse import parse_qsl

from .metrics import MetricsHistory
from .state import State, same_secret
from .system_api import parse_init

REQUEST_LINE = b"POST /init HTTP/1.1\r\n"
HISTORY_LINE = b"GET /metrics/history"
MAX_HEAD = 16 * 1024  # a larger head is not the node's: aiohttp judges it
MAX_BODY = 1 << 20
NO_CONTENT = b"HTTP/1.1 204 No Content\r\nAccess-Control-Allow-Origin: *\r\n"
JSON_OK = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\nAccess-Control-Allow-Origin: *\r\n"
)


class InitFastPath(asyncio.Protocol):
    """One connection: the node's `/init` and `/metrics/history` requests answered here until
    anything else arrives."""

    def __init__(self, state: State, history: MetricsHistory, fallback: Callable[[], asyncio.Protocol]):
        self.state = state
        self.history = history
        self.fallback = fallback
        self.transport: asyncio.Transport | None = None
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream server's transport (uvloop's does not subclass asyncio.Transport)
        self.transport = cast(asyncio.Transport, transport)
        peer = self.transport.get_extra_info("peername")
        host_peer = self.state.host_peer
        if host_peer is None or not peer or peer[0] != host_peer:
            self._hand_over()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.buffer and self.transport is not None:
            if not self._answer_one():
                return

    def eof_received(self) -> bool:
        return False  # close the transport

    def _answer_one(self) -> bool:
        """Answer the buffered request if it is complete; False when more bytes are needed or
        the connection went to aiohttp."""
        buffer = self.buffer
        if buffer.startswith(HISTORY_LINE[: len(buffer)]):
            return self._answer_history()
        if not buffer.startswith(REQUEST_LINE[: len(buffer)]):
            self._hand_over()
            return False
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > MAX_HEAD:
                self._hand_over()
            return False
        headers = _headers(buffer[len(REQUEST_LINE) : end])
        length = headers.get(b"content-length", b"")
        if not length.isdigit() or int(length) > MAX_BODY or b"transfer-encoding" in headers:
            self._hand_over()
            return False
        start = end + 4
        if len(buffer) < start + int(length):
            return False
        parsed = parse_init(buffer[start : start + int(length)])
        if isinstance(parsed, str) or parsed.mounts is not None:
            self._hand_over()  # aiohttp answers it: a JSON error, or mounts that take a thread
            return False
        parsed.apply(self.state)
        self.buffer = buffer[start + int(length) :]
        return self._reply(NO_CONTENT, b"", headers)

    def _answer_history(self) -> bool:
        """`GET /metrics/history[?start=&end=]` with the access token and no body; anything
        else of that kind (a bad query, no token) is aiohttp's to refuse."""
        buffer = self.buffer
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > MAX_HEAD:
                self._hand_over()
            return False
        line, _, head = buffer[:end].partition(b"\r\n")
        target, _, version = line[len(b"GET ") :].partition(b" ")
        path, _, query = target.partition(b"?")
        headers = _headers(head)
        bounds = _bounds(query)
        token = self.state.access_token
        sent = headers.get(b"x-access-token", b"").decode("utf-8", "surrogateescape")
        if (
            path != HISTORY_LINE[len(b"GET ") :]
            or version != b"HTTP/1.1"
            or bounds is None
            or headers.get(b"content-length", b"0") != b"0"
            or b"transfer-encoding" in headers
            or (token and not same_secret(sent, token))
        ):
            self._hand_over()
            return False
        self.buffer = buffer[end + 4 :]
        return self._reply(JSON_OK, json.dumps(self.history.answer(*bounds)).encode(), headers)

    def _reply(self, status: bytes, body: bytes, headers: dict[bytes, bytes]) -> bool:
        """Write an answer; False when the request asked to close the connection."""
        assert self.transport is not None
        length = b"Content-Length: %d\r\n" % len(body) if body else b""
        if headers.get(b"connection", b"").lower() == b"close":
            self.transport.write(status + length + b"Connection: close\r\n\r\n" + body)
            self.transport.close()
            self.transport = None
            return False
        self.transport.write(status + length + b"\r\n" + body)
        return True

    def _hand_over(self) -> None:
        """Give the connection, and what was read of it so far, to aiohttp."""
        transport, data = self.transport, self.buffer
        self.transport, self.buffer = None, b""
        assert transport is not None
        protocol = self.fallback()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if data:
            protocol.data_received(data)


def _headers(head: bytes) -> dict[bytes, bytes]:
    """Header lines by lower-cased name (a repeated name: the last one; a line without a colon
    gives no name aiohttp would accept, so it is kept as one that makes the request not ours)."""
    headers = {}
    for line in head.split(b"\r\n"):
        name, sep, value = line.partition(b":")
        headers[name.strip().lower() if sep else b"transfer-encoding"] = value.strip()
    return headers


def _bounds(query: bytes) -> tuple[int | None, int | None] | None:
    """`start` and `end` of a history query (Unix seconds, each optional); None if the query
    holds anything else, a name twice, or a value that is not a plain integer (aiohttp answers it)."""
    found: dict[str, int | None] = {}
    for name, value in parse_qsl(query.decode("latin-1"), keep_blank_values=True):
        if (
            name not in ("start", "end")
            or name in found
            or not (value == "" or (value.isascii() and value.isdigit()))
        ):
            return None
        found[name] = int(value) if value else None
    return found.get("start"), found.get("end")
