"""An interactive shell in a sandbox: a PTY process in envd, the local terminal in raw mode in between.

Keys travel as bytes (Ctrl-C and Ctrl-D included: in raw mode the local terminal sends them instead of
acting on them), output is written as it comes, SIGWINCH becomes a PTY resize, and the terminal is
restored however the session ends: shell exit, dropped connection, or a signal to the CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import termios
import time
import tty
from collections.abc import AsyncIterator
from typing import Any

import httpx

from .api import Api
from .config import CLIError
from .envd import Envd, EnvdError, exit_status, unb64

SAFE_TERMS = {
    "xterm", "xterm-256color", "screen", "screen-256color", "tmux", "tmux-256color",
    "linux", "vt100", "vt220", "dumb",
}  # fmt: skip
PASSTHROUGH_ENV = ("COLORTERM", "LANG", "LC_ALL", "LC_CTYPE")
REFRESH_EVERY_S = 60.0
REFRESH_DURATION_S = 300
LOST = 255  # as ssh: the session ended without the remote shell's exit status


def shell_env() -> dict[str, str]:
    """TERM limited to values any guest's terminfo knows; locale passed through."""
    term = os.environ.get("TERM", "")
    env = {"TERM": term if term in SAFE_TERMS else "xterm-256color"}
    env.update({k: os.environ[k] for k in PASSTHROUGH_ENV if os.environ.get(k)})
    env.setdefault("LANG", "C.UTF-8")
    return env


def terminal_size(fd: int) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        return 80, 24
    return size.columns or 80, size.lines or 24


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            time.sleep(0.005)


async def start_shell(
    envd: Envd, cols: int, rows: int, env: dict[str, str], cwd: str | None = None
) -> tuple[int, AsyncIterator[dict[str, Any]]]:
    """Start a login bash on a PTY (sh where there is no bash); its PID and its output stream."""
    for program in ("/bin/bash", "/bin/sh"):
        process: dict[str, Any] = {"cmd": program, "args": ["-i", "-l"], "envs": env}
        if cwd:
            process["cwd"] = cwd
        body = {"process": process, "pty": {"size": {"cols": cols, "rows": rows}}}
        events = envd.stream("process.Process/Start", body, as_user=True)
        try:
            first = await anext(events)
        except EnvdError as exc:
            if program == "/bin/bash" and exc.rpc_code == "invalid_argument":
                continue
            raise
        except StopAsyncIteration:
            break
        pid = first.get("event", {}).get("start", {}).get("pid")
        if pid is not None:
            return int(pid), events
        break
    raise CLIError(f"sandbox {envd.sandbox_id} did not start a shell")


class Session:
    """One shell session; `run` returns the shell's exit status (or LOST)."""

    def __init__(self, api: Api, envd: Envd, *, cwd: str | None = None):
        self.api = api
        self.envd = envd
        self.cwd = cwd
        self.stdin = sys.stdin.fileno()
        self.stdout = sys.stdout.fileno()
        self.queue: asyncio.Queue[bytes | tuple[int, int]] = asyncio.Queue()
        self.active = False

    async def _start(self) -> tuple[int, AsyncIterator[dict[str, Any]]]:
        cols, rows = terminal_size(self.stdin if os.isatty(self.stdin) else self.stdout)
        return await start_shell(self.envd, cols, rows, shell_env(), self.cwd)

    def _on_input(self) -> None:
        try:
            data = os.read(self.stdin, 65536)
        except BlockingIOError:
            return
        if not data:
            # Piped input ended: Ctrl-D asks the shell to end too (a terminal never gets here).
            asyncio.get_running_loop().remove_reader(self.stdin)
            data = b"\x04"
        self.active = True
        self.queue.put_nowait(data)

    def _on_resize(self) -> None:
        self.queue.put_nowait(terminal_size(self.stdin))

    async def _send(self, pid: int) -> None:
        """Input and resizes in order; queued keystrokes go out together. A failed send is dropped:
        if the sandbox or the shell is gone, the output stream ends and says so."""
        while True:
            item = await self.queue.get()
            with contextlib.suppress(EnvdError, httpx.HTTPError):
                if isinstance(item, tuple):
                    await self.envd.resize(pid, *item)
                    continue
                while not self.queue.empty() and isinstance(self.queue._queue[0], bytes):  # type: ignore[attr-defined]
                    item += self.queue.get_nowait()  # type: ignore[operator]
                await self.envd.send_input(pid, item, pty=True)

    async def _keep_alive(self) -> None:
        """While someone types, keep the sandbox's TTL from running out under them."""
        path = f"/sandboxes/{self.envd.sandbox_id}/refreshes"
        while True:
            await asyncio.sleep(REFRESH_EVERY_S)
            if self.active:
                self.active = False
                body = {"duration": REFRESH_DURATION_S}
                with contextlib.suppress(CLIError):
                    await asyncio.to_thread(self.api.call, "POST", path, json=body)

    async def _output(self, events: AsyncIterator[dict[str, Any]]) -> int:
        async for message in events:
            event = message.get("event", {})
            if "data" in event:
                data = event["data"]
                chunk = data.get("pty") or data.get("stdout") or data.get("stderr")
                if chunk:
                    write_all(self.stdout, unb64(chunk))
            elif "end" in event:
                return exit_status(event["end"])
        return LOST

    def _why_lost(self) -> str:
        sandbox_id = self.envd.sandbox_id
        try:
            state = self.api.sandbox(sandbox_id).get("state")
        except CLIError:
            return f"Sandbox {sandbox_id} is gone."
        if state == "paused":
            return f"Sandbox {sandbox_id} has been paused. Run `aenv resume {sandbox_id}` to resume it."
        return f"Lost the connection to sandbox {sandbox_id}. Run `aenv cn {sandbox_id}` to reconnect."

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        saved = termios.tcgetattr(self.stdin) if os.isatty(self.stdin) else None
        main = asyncio.current_task()
        assert main is not None
        watched = [signal.SIGTERM, signal.SIGHUP]
        helpers: list[asyncio.Task[None]] = []
        code, notice = LOST, "Session closed by a signal."
        try:
            # Raw before the session starts, as ssh does: keys typed meanwhile are not echoed locally.
            if saved is not None:
                tty.setraw(self.stdin, termios.TCSANOW)
            pid, events = await self._start()
            if saved is not None:
                loop.add_signal_handler(signal.SIGWINCH, self._on_resize)
            for sig in watched:
                loop.add_signal_handler(sig, main.cancel)
            loop.add_reader(self.stdin, self._on_input)
            helpers = [asyncio.create_task(self._send(pid)), asyncio.create_task(self._keep_alive())]
            try:
                code = await self._output(events)
            except (EnvdError, httpx.HTTPError):
                code = LOST
            if code != LOST:
                notice = f"Connection to sandbox {self.envd.sandbox_id} closed."
            else:
                notice = await asyncio.to_thread(self._why_lost)
        except asyncio.CancelledError:
            pass
        finally:
            loop.remove_reader(self.stdin)
            for sig in [*watched, signal.SIGWINCH]:
                loop.remove_signal_handler(sig)
            for task in helpers:
                task.cancel()
            if saved is not None:
                termios.tcsetattr(self.stdin, termios.TCSADRAIN, saved)
        print(f"\r\n{notice}" if saved is not None else notice, file=sys.stderr)
        return code


async def attach(api: Api, sandbox: dict[str, Any], *, user: str | None, cwd: str | None) -> int:
    envd = Envd(api.url, sandbox, user)
    try:
        return await Session(api, envd, cwd=cwd).run()
    finally:
        await envd.aclose()
