"""`aenv exec <id> -- cmd...`: run a command in a sandbox, stream its output, exit with its status."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
import sys
import threading
from typing import Any

from .common import api, key_value, positive
from .config import CLIError
from .envd import Envd, EnvdError, exit_status, unb64
from .terminal import write_all

CHUNK = 64 * 1024


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "exec", help="run a command in a sandbox (stdin forwarded when piped)",
        description="Runs the command with `bash -l -c` in the sandbox: one argument is a shell script "
        "(`aenv exec ID 'ls | wc -l'`), several are quoted as an argv (`aenv exec ID -- ls -la`).",
    )  # fmt: skip
    parser.add_argument("-u", "--user", help="Linux user to run as (default: the template's, `user`)")
    parser.add_argument("-w", "--cwd", help="working directory")
    parser.add_argument("-e", "--env", action="append", type=key_value, default=[], metavar="K=V")
    parser.add_argument("--timeout", type=positive, help="kill the command after this many seconds")
    parser.add_argument("-n", "--no-stdin", action="store_true", help="do not forward stdin even if piped")
    parser.add_argument("sandbox_id")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="command and arguments (after --)")
    parser.set_defaults(run=run)


def script(command: list[str]) -> str:
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CLIError("no command given: use `aenv exec <id> -- <command> [args...]`")
    return command[0] if len(command) == 1 else shlex.join(command)


def _read_stdin(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[bytes]) -> None:
    """A daemon thread: a blocked read must not keep the CLI alive once the command has ended."""
    fd = sys.stdin.fileno()
    while True:
        try:
            data = os.read(fd, CHUNK)
        except OSError:
            data = b""
        loop.call_soon_threadsafe(queue.put_nowait, data)
        if not data:
            return


async def _pump_stdin(envd: Envd, pid: int) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=0)
    threading.Thread(target=_read_stdin, args=(loop, queue), daemon=True, name="stdin").start()
    while data := await queue.get():
        await envd.send_input(pid, data, pty=False)
    await envd.close_stdin(pid)


async def execute(args: argparse.Namespace, url: str, sandbox: dict[str, Any], forward_stdin: bool) -> int:
    process: dict[str, Any] = {"cmd": "/bin/bash", "args": ["-l", "-c", script(args.command)]}
    if args.env:
        process["envs"] = dict(args.env)
    if args.cwd:
        process["cwd"] = args.cwd
    envd = Envd(url, sandbox, args.user)
    loop = asyncio.get_running_loop()
    events = envd.stream(
        "process.Process/Start", {"process": process, "stdin": forward_stdin},
        as_user=True, deadline_s=args.timeout,
    )  # fmt: skip
    pumping: asyncio.Task[None] | None = None
    interrupts = 0
    pid = 0
    signals: set[asyncio.Task[None]] = set()

    def interrupt() -> None:
        """Ctrl-C stops the remote command (SIGTERM, then SIGKILL), whose end then ends the CLI."""
        nonlocal interrupts
        interrupts += 1
        if pid:
            task = asyncio.create_task(envd.signal(pid, "SIGTERM" if interrupts == 1 else "SIGKILL"))
            signals.add(task)
            task.add_done_callback(signals.discard)

    loop.add_signal_handler(signal.SIGINT, interrupt)
    try:
        async for message in events:
            event = message.get("event", {})
            if "start" in event:
                pid = int(event["start"].get("pid", 0))
                if forward_stdin:
                    pumping = asyncio.create_task(_pump_stdin(envd, pid))
            elif "data" in event:
                data = event["data"]
                if data.get("stdout"):
                    write_all(sys.stdout.fileno(), unb64(data["stdout"]))
                if data.get("stderr"):
                    write_all(sys.stderr.fileno(), unb64(data["stderr"]))
            elif "end" in event:
                return exit_status(event["end"])
        raise CLIError("the command's output stream ended without an exit status")
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        if pumping is not None:
            pumping.cancel()
            with contextlib.suppress(asyncio.CancelledError, EnvdError, CLIError):
                await pumping
        await envd.aclose()


def run(args: argparse.Namespace) -> int:
    script(args.command)
    client = api()
    sandbox = client.sandbox(args.sandbox_id)
    if sandbox.get("state") == "paused":
        raise CLIError(f"sandbox {args.sandbox_id} is paused; run `aenv resume {args.sandbox_id}` first")
    forward = not args.no_stdin and not sys.stdin.isatty()
    return asyncio.run(execute(args, client.url, sandbox, forward))
