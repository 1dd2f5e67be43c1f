"""Byte-level TCP forwarding from a host loopback port to a port inside a sandbox's namespace.

Used to hand a guest service (envd first of all) to host-side clients that only know how to
dial an address, such as the E2B SDK in single-URL mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from .netns import GUEST_ADDRESS, SandboxNetwork

log = logging.getLogger(__name__)

_CHUNK = 256 * 1024


async def open_guest_connection(
    network: SandboxNetwork, port: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to `port` of the guest through the sandbox's namespace."""
    sock = network.socket()
    try:
        await asyncio.get_running_loop().sock_connect(sock, (GUEST_ADDRESS, port))
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock, limit=_CHUNK)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


async def _splice(
    client_reader: asyncio.StreamReader,
    client_writer: asyncio.StreamWriter,
    network: SandboxNetwork,
    port: int,
) -> None:
    try:
        guest_reader, guest_writer = await open_guest_connection(network, port)
    except OSError as exc:
        log.debug("forward to guest port %d failed: %s", port, exc)
        client_writer.close()
        return
    try:
        await asyncio.gather(_pump(client_reader, guest_writer), _pump(guest_reader, client_writer))
    finally:
        # No await in here: when a dropped connection task is collected, this runs on GeneratorExit.
        for writer in (guest_writer, client_writer):
            writer.close()
    for writer in (guest_writer, client_writer):
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def forward_port(
    network: SandboxNetwork, guest_port: int, host: str = "127.0.0.1", port: int = 0
) -> asyncio.Server:
    """Listen on host:port (0 picks a free port) and forward each connection to the guest."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A connection task ends quietly when the loop shuts down: nothing awaits it, and
        # asyncio would otherwise log the cancellation as an error.
        with contextlib.suppress(asyncio.CancelledError):
            await _splice(reader, writer, network, guest_port)

    return await asyncio.start_server(handle, host, port)
