"""Validation of what clients send: every bad value becomes a 4xx error, never a crash (a 500).

RPC requests arrive as proto3 JSON, where a field of the wrong type is a decoding error that
connect-go answers with `invalid_argument`; these readers give the same answer. Values that the
kernel takes as C strings (paths, user names, argv, environment) must not contain NUL bytes, and
paths must fit PATH_MAX. Helpers raise `ConnectError`, which the HTTP routes render as the
reference envd's `{"code": <status>, "message": ...}` JSON with the matching status.
"""

from __future__ import annotations

import math
from typing import Any

from .connect import ConnectError, Message, field

PATH_MAX = 4096  # bytes, including the terminating NUL
UINT32_MAX = 2**32 - 1
_MISSING = object()


def invalid(message: str) -> ConnectError:
    return ConnectError("invalid_argument", message)


def c_string(value: str, what: str) -> str:
    """A string the kernel will see as a C string: no NUL bytes, encodable to the filesystem encoding."""
    if "\0" in value:
        raise invalid(f"{what} must not contain NUL bytes")
    try:
        value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise invalid(f"{what} is not valid UTF-8") from None
    return value


def path_string(value: str, what: str = "path") -> str:
    """A path the kernel can take: a C string shorter than PATH_MAX bytes."""
    c_string(value, what)
    if len(value.encode("utf-8", "surrogateescape")) >= PATH_MAX:
        raise invalid(f"{what} is longer than {PATH_MAX - 1} bytes")
    return value


def text(msg: Message | None, camel: str, snake: str | None = None, default: str = "") -> str:
    value = field(msg, camel, snake, _MISSING)
    if value is _MISSING or value is None:
        return default
    if not isinstance(value, str):
        raise invalid(f"{camel} must be a string")
    return value


def optional_text(msg: Message | None, camel: str, snake: str | None = None) -> str | None:
    return text(msg, camel, snake) if field(msg, camel, snake) is not None else None


def flag(msg: Message | None, camel: str, snake: str | None = None) -> bool | None:
    value = field(msg, camel, snake)
    if value is not None and not isinstance(value, bool):
        raise invalid(f"{camel} must be a boolean")
    return value


def obj(msg: Message | None, camel: str, snake: str | None = None) -> Message | None:
    value = field(msg, camel, snake)
    if value is not None and not isinstance(value, dict):
        raise invalid(f"{camel} must be an object")
    return value


def uint32(msg: Message | None, camel: str, snake: str | None = None, default: int = 0) -> int:
    """A proto3 JSON uint32: a number or a decimal string, whole and in range."""
    value = field(msg, camel, snake)
    if value is None:
        return default
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise invalid(f"{camel} must be an unsigned integer") from None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= UINT32_MAX:
        raise invalid(f"{camel} must be an unsigned 32-bit integer")
    return value


def strings(msg: Message | None, camel: str, what: str) -> list[str]:
    """A repeated string field whose items are C strings."""
    value = field(msg, camel)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise invalid(f"{camel} must be a list of strings")
    return [c_string(item, what) for item in value]


def string_map(value: Any, what: str) -> dict[str, str]:
    """A proto3 `map<string, string>`."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise invalid(f"{what} must map names to strings")
    return dict(value)


def environment(env: dict[str, str]) -> dict[str, str]:
    """An environment a process can get: names non-empty without '=' or NUL, values without NUL."""
    for name, value in env.items():
        if not name or "=" in name:
            raise invalid(f"invalid environment variable name {name[:64]!r}")
        c_string(name, "environment variable name")
        c_string(value, f"value of environment variable {name[:64]}")
    return env
