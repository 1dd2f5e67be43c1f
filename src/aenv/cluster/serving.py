"""Running one of the cluster's services (the scheduler, a gateway) as a process: settings and
logging, listening on its `host:port`, stopping cleanly on SIGINT or SIGTERM.

Connections are served by the API's runner, so even requests aiohttp's parser refuses are
answered with `{"code", "message"}`. The event loop is uvloop's: these processes do nothing but
move small HTTP and Redis messages, where libuv's loop and socket calls cost about half of
asyncio's (a create through a gateway makes three such hops).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import uvloop
from aiohttp import web

from .. import logs
from ..api.runner import BACKLOG, APIRunner
from ..config import ConfigError, Settings, load_settings

log = logging.getLogger(__name__)


def split_addr(addr: str) -> tuple[str, int]:
    """`host:port` as its parts; ConfigError for anything else."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"expected host:port, got {addr!r}")
    return host, int(port)


async def listen_until_stopped(app: web.Application, addr: str, name: str, **options: Any) -> None:
    """Serve `app` on `addr` until the process is asked to stop; `options` go to the runner."""
    host, port = split_addr(addr)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runner = APIRunner(app, access_log=None, handle_signals=False, **options)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_address=True, backlog=BACKLOG).start()
        log.info("%s listening on http://%s", name, addr)
        await stop.wait()
        log.info("%s stopping", name)
    finally:
        await runner.cleanup()


def run(serve: Callable[[Settings], Awaitable[None]]) -> None:
    """The process: settings from the environment, logging, then `serve` until stopped."""
    try:
        settings = load_settings()
    except ConfigError as exc:
        raise SystemExit(f"aenv: {exc}") from None
    logs.configure(settings.log_level, settings.log_format)
    with contextlib.suppress(KeyboardInterrupt):
        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(serve(settings))
        except ConfigError as exc:
            raise SystemExit(f"aenv: {exc}") from None
