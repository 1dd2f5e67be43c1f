"""Entry point: `python3 -m <package> --port 49983`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path

import uvloop

from . import ENVD_PORT, ENVD_VERSION
from .server import serve
from .state import State


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="envd", description=f"E2B-compatible envd {ENVD_VERSION}")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=ENVD_PORT)
    parser.add_argument("--default-user", default="user", help="user for requests that name none")
    parser.add_argument("--default-workdir", default=None, help="cwd for commands (default: user's home)")
    parser.add_argument(
        "--host-peer",
        default=None,
        help="address of the node (tap gateway); its /init may replace the access token",
    )
    parser.add_argument(
        "--state-file",
        type=Path,
        default=None,
        help="where to keep what /init set, so that a restarted envd takes it over (root-only)",
    )
    parser.add_argument(
        "--exec-helper",
        required=True,
        help="the aenv-exec program, through which every command is started",
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level.upper(),
        format="%(asctime)s envd %(levelname)s %(name)s: %(message)s",
    )
    state = State(
        exec_helper=args.exec_helper,
        default_user=args.default_user,
        default_workdir=args.default_workdir,
        host_peer=args.host_peer,
        store=args.state_file,
    )
    state.restore()

    async def run() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)  # type: ignore[union-attr]
        await serve(state, args.host, args.port)

    # uvloop: under TCG each restored guest in a new QEMU process (a fork's child, a released
    # resume) translates envd's code afresh, and libuv's C event loop is less code to translate
    # than asyncio's Python one on the way to the node's first `/init`.
    runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    with runner, contextlib.suppress(asyncio.CancelledError):
        runner.run(run())


if __name__ == "__main__":
    main()
