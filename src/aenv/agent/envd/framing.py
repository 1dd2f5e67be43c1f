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


def envelope(payload: bytes, flags: int = 0) -> bytes:
    """One Connect streaming envelope (the host's envd clients frame requests with it too)."""
    return struct.pack(">BI", flags, len(payload)) + payload


def envelope_header(header: bytes) -> tuple[int, int]:
    """The flags and payload length of an envelope's header."""
    flags, length = struct.unpack(">BI", header)
    return flags, length


async def envelopes(chunks: AsyncIterable[bytes]) -> AsyncIterator[tuple[int, Message]]:
    """The envelopes of a streamed body, as it arrives in chunks: each one's flags and JSON
    message (the host's envd clients read responses with it)."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while len(buffer) >= ENVELOPE_HEADER:
            flags, size = envelope_header(buffer[:ENVELOPE_HEADER])
            end = ENVELOPE_HEADER + size
            if len(buffer) < end:
                break
            yield flags, json.loads(buffer[ENVELOPE_HEADER:end] or b"{}")
            buffer = buffer[end:]
