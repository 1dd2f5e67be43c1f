"""Connect streaming envelopes: framing only, on the standard library.

Kept apart from `connect` (which serves them with aiohttp) because the `aenv` CLI frames its
envd calls with these too, and a client-only install of the CLI has no aiohttp.
"""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

Message = dict[str, Any]

FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02
ENVELOPE_HEADER = 5  # bytes: one flags byte, then the payload's length (big-endian uint32)
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # the largest message envd takes, and its clients read by default


def envelope(payload: bytes, flags: int = 0) -> bytes:
    """One Connect streaming envelope (the host's envd clients frame requests with it too)."""
    return struct.pack(">BI", flags, len(payload)) + payload


def envelope_header(header: bytes) -> tuple[int, int]:
    """The flags and payload length of an envelope's header."""
    flags, length = struct.unpack(">BI", header)
    return flags, length


class MessageTooLarge(ValueError):
    """An envelope announced a message larger than its reader takes."""


async def envelopes(
    chunks: AsyncIterable[bytes], limit: int = MAX_MESSAGE_BYTES
) -> AsyncIterator[tuple[int, Message]]:
    """The envelopes of a streamed body, as it arrives in chunks: each one's flags and JSON
    message (the host's envd clients read responses with it). A message announced larger than
    `limit` bytes is `MessageTooLarge`, before it is read: the other side may be hostile."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while len(buffer) >= ENVELOPE_HEADER:
            flags, size = envelope_header(buffer[:ENVELOPE_HEADER])
            if size > limit:
                raise MessageTooLarge(f"a message of {size} bytes, more than the {limit} taken")
            end = ENVELOPE_HEADER + size
            if len(buffer) < end:
                break
            yield flags, json.loads(buffer[ENVELOPE_HEADER:end] or b"{}")
            buffer = buffer[end:]
