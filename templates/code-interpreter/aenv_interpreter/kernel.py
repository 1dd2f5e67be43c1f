"""A Python kernel: runs cells in one namespace and reports what they print, show and raise.

The service starts one per context and talks to it over the kernel's original stdin and stdout:
a JSON line per cell (``{"code", "env_vars"}``) in, the SDK's messages (``stdout``, ``stderr``,
``result``, ``error``, ``number_of_executions``) as JSON lines out, then ``end_of_execution``.
File descriptors 1 and 2 become pipes read by the kernel itself, so output of ``print`` and of
child processes alike streams to the client as it is written. A cell runs like a Jupyter cell:
the value of a final expression is its main result (unless the cell ends with ``;``), top-level
``await``, ``!command`` and ``%pip`` work, and a traceback names the cell's own lines.
``SIGINT`` interrupts a running cell.
"""

from __future__ import annotations

import ast
import asyncio
import codecs
import inspect
import io
import json
import linecache
import os
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
import types
from typing import Any, BinaryIO

from aenv_interpreter import display

READ_CHUNK = 65536


class Channel:
    """The kernel's end of the service's pipe: one JSON message a line, from any thread."""

    def __init__(self, stream: BinaryIO):
        self.stream = stream
        self.lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        line = json.dumps(message, default=str).encode() + b"\n"
        with self.lock:
            self.stream.write(line)
            self.stream.flush()


class Capture(threading.Thread):
    """Forwards what is written to a file descriptor as ``stdout``/``stderr`` messages.

    ``drain`` writes a marker into the pipe and waits until it comes out: everything written
    before it has been sent, so a cell's output always precedes its end.
    """

    def __init__(self, fd: int, name: str, channel: Channel):
        super().__init__(name=f"capture-{name}", daemon=True)
        self.name_ = name
        self.channel = channel
        read, write = os.pipe()
        os.dup2(write, fd)
        os.close(write)
        self.fd, self.read_end = fd, read
        self.marker = b"\x00aenv-drain-" + secrets.token_hex(8).encode() + b"\x00"
        self.drained = threading.Event()

    def run(self) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        pending = b""
        while True:
            chunk = os.read(self.read_end, READ_CHUNK)
            if not chunk:
                return
            pending += chunk
            while self.marker in pending:
                before, pending = pending.split(self.marker, 1)
                self._send(decoder.decode(before))
                self.drained.set()
            ready, pending = _split_tail(pending, self.marker)
            self._send(decoder.decode(ready))

    def _send(self, text: str) -> None:
        if text:
            self.channel.send({"type": self.name_, "text": text, "timestamp": time.time_ns()})

    def drain(self, timeout: float = 5.0) -> None:
        self.drained.clear()
        os.write(self.fd, self.marker)
        self.drained.wait(timeout)


def _parse(code: str, filename: str) -> ast.Module:
    """The cell's syntax tree; a cell that is not Python may use IPython's shell escapes:
    lines starting with ``!`` run in the shell, ``%pip`` runs this interpreter's pip."""
    try:
        tree = ast.parse(code, filename)
    except SyntaxError:
        shell = _shell_escapes(code)
        if shell == code:
            raise
        code, tree = shell, ast.parse(shell, filename)
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    return tree


def _shell_escapes(code: str) -> str:
    lines = []
    for line in code.split("\n"):
        body = line.lstrip()
        indent = line[: len(line) - len(body)]
        if body.startswith("!"):
            line = f"{indent}__aenv_shell__({body[1:]!r})"
        elif body.split(None, 1)[:1] == ["%pip"]:
            line = f"{indent}__aenv_shell__({shlex.quote(sys.executable) + ' -m pip' + body[4:]!r})"
        lines.append(line)
    return "\n".join(lines)


def shell(command: str) -> None:
    """A cell's ``!command``: its output streams like the cell's own."""
    sys.stdout.flush()
    subprocess.run(command, shell=True, check=False)


def _split_tail(data: bytes, marker: bytes) -> tuple[bytes, bytes]:
    """``data`` as what can be sent now and the end that may be the start of a marker."""
    for size in range(min(len(marker) - 1, len(data)), 0, -1):
        if data.endswith(marker[:size]):
            return data[:-size], data[-size:]
    return data, b""


class Kernel:
    def __init__(self, channel: Channel):
        self.channel = channel
        self.count = 0
        self.running = False
        self.loop = asyncio.new_event_loop()
        self.namespace: dict[str, Any] = {
            "__name__": "__main__",
            "__builtins__": __builtins__,
            "display": display.display,
            "__aenv_shell__": shell,
        }
        sys.modules["__main__"] = types.ModuleType("__main__")
        sys.modules["__main__"].__dict__.update(self.namespace)
        self.namespace = sys.modules["__main__"].__dict__

    def interrupt(self, signum: int, frame: types.FrameType | None) -> None:
        if self.running:
            raise KeyboardInterrupt

    def execute(self, code: str, env: dict[str, str]) -> None:
        self.count += 1
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            value, show = self._run(code)
            display.flush_figures()
            if show and value is not None:
                self.namespace["_"] = value
                self.channel.send({"type": "result", **display.formats(value), "is_main_result": True})
        except BaseException as exc:  # everything a cell raises is the cell's error
            self._report(exc)
        finally:
            self._restore(saved)
            sys.stdout.flush()
            sys.stderr.flush()
        self.channel.send({"type": "number_of_executions", "execution_count": self.count})

    def _run(self, code: str) -> tuple[Any, bool]:
        filename = f"<cell-{self.count}>"
        tree = _parse(code, filename)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        flags = getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)
        self.running = True
        try:
            self._eval(compile(tree, filename, "exec", flags=flags))
            if last is None:
                return None, False
            expression = ast.Expression(body=last.value)
            value = self._eval(compile(expression, filename, "eval", flags=flags))
            return value, not code.rstrip().endswith(";")
        finally:
            self.running = False

    def _eval(self, compiled: types.CodeType) -> Any:
        value = eval(compiled, self.namespace)
        if compiled.co_flags & inspect.CO_COROUTINE:
            value = self.loop.run_until_complete(value)
        return value

    def _report(self, exc: BaseException) -> None:
        tb = exc.__traceback__
        while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<cell-"):
            tb = tb.tb_next  # the kernel's own frames are not the user's business
        lines = traceback.format_exception(type(exc), exc, tb)
        self.channel.send(
            {"type": "error", "name": type(exc).__name__, "value": str(exc), "traceback": "".join(lines)}
        )

    @staticmethod
    def _restore(saved: dict[str, str | None]) -> None:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def main() -> None:
    requests = os.fdopen(os.dup(0), "rb")
    channel = Channel(os.fdopen(os.dup(1), "wb"))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    captures = [Capture(1, "stdout", channel), Capture(2, "stderr", channel)]
    for capture in captures:
        capture.start()
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    os.environ.setdefault("MPLBACKEND", "module://aenv_interpreter.mpl_backend")
    display.emit = channel.send
    kernel = Kernel(channel)
    signal.signal(signal.SIGINT, kernel.interrupt)
    for line in requests:
        request = json.loads(line)
        kernel.execute(request["code"], request.get("env_vars") or {})
        for capture in captures:
            capture.drain()
        channel.send({"type": "end_of_execution"})


if __name__ == "__main__":
    main()
