"""Connect-RPC wire protocol (JSON codec only): envelopes, errors, unary and streaming responses."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from .framing import (
    FLAG_COMPRESSED,
    FLAG_END_STREAM,
    MAX_MESSAGE_BYTES,
    Message,
    envelope,
    envelope_header,
)

JSON_CT = "application/json"
STREAM_CT = "application/connect+json"
DEFAULT_KEEPALIVE_S = 90.0

# Canonical Connect code -> HTTP status (connect protocol spec).
HTTP_STATUS = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}

log = logging.getLogger(__name__)


class ConnectError(Exception):
    """An RPC failure carrying a Connect error code; rendered per the unary or streaming rules."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def to_json(self) -> Message:
        return {"code": self.code, "message": self.message}


def os_error(err: OSError, what: str) -> ConnectError:
    """Map an OSError to the Connect code the reference envd uses for the same condition."""
    code = {
        errno.ENOENT: "not_found",
        errno.EACCES: "permission_denied",
        errno.EPERM: "permission_denied",
        errno.EROFS: "permission_denied",
        errno.ENOTDIR: "invalid_argument",
        errno.EISDIR: "invalid_argument",
        errno.ENAMETOOLONG: "invalid_argument",
        errno.EINVAL: "invalid_argument",
        errno.EEXIST: "already_exists",
        errno.ENOTEMPTY: "already_exists",
        errno.ELOOP: "failed_precondition",
        errno.EXDEV: "failed_precondition",
        errno.ENOSPC: "resource_exhausted",
        errno.EDQUOT: "resource_exhausted",
    }.get(err.errno or 0, "internal")
    return ConnectError(code, f"{what}: {err.strerror or err}")


def field(msg: Message | None, camel: str, snake: str | None = None, default: Any = None) -> Any:
    """Read a proto3-JSON field, accepting both the lowerCamelCase and the original snake_case name."""
    if not isinstance(msg, dict):
        return default
    if camel in msg:
        return msg[camel]
    if snake is not None and snake in msg:
        return msg[snake]
    return default


def encode_message(msg: Message) -> bytes:
    return envelope(json.dumps(msg, separators=(",", ":")).encode())


def end_stream(error: ConnectError | None = None) -> bytes:
    body: Message = {"error": error.to_json()} if error else {}
    return envelope(json.dumps(body).encode(), FLAG_END_STREAM)


def timeout_seconds(request: web.Request) -> float | None:
    """The `Connect-Timeout-Ms` deadline in seconds, or None when absent/invalid/zero (= unlimited)."""
    raw = request.headers.get("Connect-Timeout-Ms")
    if not raw:
        return None
    try:
        ms = int(raw)
    except ValueError:
        return None
    return ms / 1000 if ms > 0 else None


def keepalive_seconds(request: web.Request) -> float:
    """Keepalive period requested by the client (`Keepalive-Ping-Interval`, seconds), default 90 s."""
    raw = request.headers.get("Keepalive-Ping-Interval", "")
    try:
        value = int(raw)
    except ValueError:
        return DEFAULT_KEEPALIVE_S
    return float(value) if value > 0 else DEFAULT_KEEPALIVE_S


def _codec_error(content_type: str, expected: str) -> web.Response:
    return web.json_response(
        {"code": "unknown", "message": f"invalid content-type: {content_type!r}; expecting {expected!r}"},
        status=415,
    )


async def read_envelope(request: web.Request) -> Message | None:
    """Read one request envelope from a streaming body; None at a clean end of the body."""
    try:
        header = await request.content.readexactly(5)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise ConnectError("invalid_argument", "truncated envelope header") from None
    flags, length = envelope_header(header)
    if length > MAX_MESSAGE_BYTES:
        raise ConnectError("resource_exhausted", "message too large")
    try:
        payload = await request.content.readexactly(length)
    except asyncio.IncompleteReadError:
        raise ConnectError("invalid_argument", "truncated envelope") from None
    if flags & FLAG_COMPRESSED:
        raise ConnectError("internal", "compressed messages are not supported")
    if flags & FLAG_END_STREAM:
        return None
    return _decode(payload)


def loads(raw: bytes | str) -> Any:
    """Parse JSON; any malformed document, also one nested too deeply to parse, is a ValueError."""
    try:
        return json.loads(raw or b"{}")
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _decode(payload: bytes) -> Message:
    try:
        msg = loads(payload)
    except ValueError as e:
        raise ConnectError("invalid_argument", f"cannot decode request: {e}") from None
    if not isinstance(msg, dict):
        raise ConnectError("invalid_argument", "request must be a JSON object")
    return msg


UnaryHandler = Callable[[web.Request, Message], Awaitable[Message]]
StreamHandler = Callable[[web.Request, Message], AsyncGenerator[Message, None]]
ClientStreamHandler = Callable[[web.Request, AsyncIterator[Message]], Awaitable[Message]]


def _media_type(request: web.Request) -> str:
    return request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()


async def _read_body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ConnectError("resource_exhausted", f"request larger than {MAX_MESSAGE_BYTES} bytes") from None


def _as_connect_error(request: web.Request, error: Exception) -> ConnectError:
    """The Connect error to answer: its own for a ConnectError, `internal` (logged) for a bug."""
    if isinstance(error, ConnectError):
        return error
    log.error("%s failed", request.path, exc_info=error)
    return ConnectError("internal", f"internal error: {type(error).__name__}")


def unary(fn: UnaryHandler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Wrap a unary method: JSON request body in, JSON response or Connect error JSON out."""

    async def handler(request: web.Request) -> web.StreamResponse:
        if _media_type(request) != JSON_CT:
            return _codec_error(request.headers.get("Content-Type", ""), JSON_CT)
        try:
            msg = _decode(await _read_body(request))
            result = await fn(request, msg)
        except Exception as e:
            error = _as_connect_error(request, e)
            return web.json_response(error.to_json(), status=HTTP_STATUS.get(error.code, 500))
        return web.json_response(result)

    return handler


async def _start_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={"Content-Type": STREAM_CT})
    await resp.prepare(request)
    return resp


def server_stream(fn: StreamHandler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Wrap a server-streaming method. Errors (also before the first message) go in the end-stream frame,
    as connect-go does; a vanished client just ends the handler."""

    async def handler(request: web.Request) -> web.StreamResponse:
        if _media_type(request) != STREAM_CT:
            return _codec_error(request.headers.get("Content-Type", ""), STREAM_CT)
        resp: web.StreamResponse | None = None
        error: ConnectError | None = None
        gen: AsyncGenerator[Message, None] | None = None
        try:
            msg = await read_envelope(request) or {}
            gen = fn(request, msg)
            async for out in gen:
                if resp is None:
                    resp = await _start_stream(request)
                await resp.write(encode_message(out))
        except ConnectionError:
            return resp or web.Response(status=499)
        except Exception as e:
            error = _as_connect_error(request, e)
        finally:
            if gen is not None:
                await gen.aclose()
        if resp is None:
            resp = await _start_stream(request)
        try:
            await resp.write(end_stream(error))
            await resp.write_eof()
        except ConnectionError:
            pass
        return resp

    return handler


def client_stream(fn: ClientStreamHandler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Wrap a client-streaming method; its single response is streaming-framed (message + end-stream)."""

    async def messages(request: web.Request) -> AsyncIterator[Message]:
        while True:
            msg = await read_envelope(request)
            if msg is None:
                return
            yield msg

    async def handler(request: web.Request) -> web.StreamResponse:
        if _media_type(request) != STREAM_CT:
            return _codec_error(request.headers.get("Content-Type", ""), STREAM_CT)
        try:
            result: Message | None = await fn(request, messages(request))
            error = None
        except Exception as e:
            result, error = None, _as_connect_error(request, e)
        resp = await _start_stream(request)
        if result is not None:
            await resp.write(encode_message(result))
        await resp.write(end_stream(error))
        await resp.write_eof()
        return resp

    return handler
