"""The `aenv` command.

`aenv run` boots the base guest and exposes its envd on loopback, so the E2B SDK can drive
it (single-URL mode); the node server replaces it once the control plane exists.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
import time

from . import __version__, paths
from .guest.artifacts import ensure_guest_artifacts
from .network.forward import forward_port
from .vmm.accel import accelerator_from_env
from .vmm.envd_link import ENVD_PORT
from .vmm.launcher import boot_base_guest


async def _run(args: argparse.Namespace) -> int:
    choice = accelerator_from_env()
    print(f"aenv {__version__}: accelerator {choice.accel} ({choice.reason})", flush=True)
    artifacts = await asyncio.to_thread(ensure_guest_artifacts)
    name = f"run{secrets.token_hex(3)}"
    workdir = paths.home_dir() / "vms" / name
    started = time.monotonic()
    guest = await boot_base_guest(artifacts, workdir, name=name, accel=choice.accel)
    server = None
    try:
        server = await forward_port(guest.network, ENVD_PORT, host=args.host, port=args.port)
        host, port = server.sockets[0].getsockname()[:2]
        print(
            f"base guest {name} ready in {time.monotonic() - started:.1f} s; envd at http://{host}:{port}\n"
            f"serial log: {guest.vm.serial_log}\n"
            "Drive it with the E2B SDK:\n"
            f"  python -c \"from e2b import Sandbox; s = Sandbox(sandbox_id='{name}', envd_version='0.6.13', "
            f"debug=True, sandbox_url='http://{host}:{port}'); print(s.commands.run('uname -a').stdout)\"\n"
            "Ctrl-C shuts the guest down.",
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        if server is not None:
            server.close()
        clean = await guest.shutdown()
        print(f"guest {name} {'shut down cleanly' if clean else 'was killed'}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aenv", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"aenv {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="boot the base guest and expose its envd on loopback")
    run.add_argument("--host", default="127.0.0.1")
    run.add_argument("--port", type=int, default=int(os.environ.get("AENV_ENVD_PORT", "49983")))
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("AENV_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(message)s"
    )
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(_run(args))
    return 130


if __name__ == "__main__":
    sys.exit(main())
