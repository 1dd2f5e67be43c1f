"""The HTTP service the ``e2b-code-interpreter`` SDK talks to (port 49999).

- ``GET /health``: 200 once the default Python kernel is up (the template's ready check).
- ``POST /execute`` ``{"code", "context_id", "language", "env_vars"}``: the cell's messages as
  JSON lines (chunked), in the order the kernel sends them. The cell sees the sandbox's
  environment variables (envd's ``/envs``) and ``env_vars`` over them. A client that goes away interrupts
  the cell (``SIGINT``), as the SDK's execution timeout expects.
- ``POST /contexts`` ``{"language", "cwd"}``, ``GET /contexts``, ``POST /contexts/{id}/restart``,
  ``DELETE /contexts/{id}``: kernels, each ``{"id", "language", "cwd"}``.

Errors are ``{"code", "message"}`` with the HTTP status. Only Python kernels exist here; another
language is a 400 naming the ones there are.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from aenv_interpreter import PORT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LANGUAGES = {"python": "python", "python3": "python"}
DEFAULT_CWD = os.path.expanduser("~") if os.path.isdir(os.path.expanduser("~")) else "/"
KERNEL_BOOT = "import sys; sys.path.insert(1, sys.argv[1]); from aenv_interpreter.kernel import main; main()"
MAX_BODY = 64 << 20
ENVD_ENVS = "http://127.0.0.1:49983/envs"
READ_CHUNK = 1 << 20
INTERRUPT_GRACE = 10.0  # seconds an interrupted cell has to end


class RequestError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Kernel:
    """One context: a kernel process and the lock that runs its cells one at a time."""

    def __init__(self, context_id: str, language: str, cwd: str):
        self.id, self.language, self.cwd = context_id, language, cwd
        self.lock = threading.Lock()
        self._spawn()

    def _spawn(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", KERNEL_BOOT, ROOT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=self.cwd,
            start_new_session=True,
        )
        assert self.process.stdout is not None
        self.lines = Lines(self.process.stdout.fileno())

    def describe(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def restart(self) -> None:
        with self.lock:
            self.stop()
            self._spawn()

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()

    def execute(self, request: dict[str, Any], client: socket.socket) -> Iterator[bytes]:
        """The cell's message lines; interrupts the cell when the client goes away (or the
        generator is closed early), so the next cell starts on a kernel that is idle again."""
        with self.lock:
            stdin, stdout = self.process.stdin, self.lines
            assert stdin is not None
            try:
                stdin.write(json.dumps(request).encode() + b"\n")
                stdin.flush()
            except OSError:
                self._spawn()  # it died since its last cell: a fresh one
                raise RequestError(
                    HTTPStatus.SERVICE_UNAVAILABLE, "the kernel had exited: restarted"
                ) from None
            ended = False
            try:
                while not _gone(client, stdout):
                    line = stdout.readline()
                    if not line:
                        yield self._died()
                        ended = True
                        return
                    if json.loads(line).get("type") == "end_of_execution":
                        ended = True
                        return
                    yield line
            finally:
                if not ended:
                    self._interrupt(stdout)

    def _died(self) -> bytes:
        self.process.wait()
        self._spawn()
        return _error_line("KernelDied", "the kernel exited during the cell; it was restarted")

    def _interrupt(self, stdout: Lines) -> None:
        """Interrupt the running cell and read what is left of it (a fresh kernel if it hangs)."""
        os.kill(self.process.pid, signal.SIGINT)
        deadline = time.monotonic() + INTERRUPT_GRACE
        while time.monotonic() < deadline:
            if stdout.ready():
                line = stdout.readline()
                if not line or json.loads(line).get("type") == "end_of_execution":
                    break
        else:
            self.stop()
            self._spawn()


class Lines:
    """The kernel's messages, a line at a time, with a non-blocking look at whether one is there
    (a buffered file's ``select`` would miss lines already in its buffer)."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buffer = b""
        self.eof = False

    def ready(self, timeout: float = 0.2) -> bool:
        return b"\n" in self.buffer or self.eof or bool(select.select([self.fd], [], [], timeout)[0])

    def readline(self) -> bytes:
        """The next line; b"" once the kernel closed its end."""
        while b"\n" not in self.buffer and not self.eof:
            chunk = os.read(self.fd, READ_CHUNK)
            self.eof = not chunk
            self.buffer += chunk
        line, sep, self.buffer = self.buffer.partition(b"\n")
        if not sep:
            line, self.buffer = b"", b""
        return line + sep


def _gone(client: socket.socket, stream: Lines) -> bool:
    """Whether the client hung up (checked while the kernel has nothing to say)."""
    while not stream.ready():
        ready = select.select([client], [], [], 0)[0]
        if ready:
            try:
                return client.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                return True
    return False


def _error_line(name: str, value: str) -> bytes:
    return json.dumps({"type": "error", "name": name, "value": value, "traceback": value}).encode() + b"\n"


class Kernels:
    """The contexts of this sandbox; the default one per language is made on first use."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.contexts: dict[str, Kernel] = {}
        self.defaults: dict[str, str] = {}

    def create(self, language: str | None, cwd: str | None) -> Kernel:
        name = _language(language)
        kernel = Kernel(str(uuid.uuid4()), name, cwd or DEFAULT_CWD)
        with self.lock:
            self.contexts[kernel.id] = kernel
        return kernel

    def default(self, language: str | None) -> Kernel:
        name = _language(language)
        with self.lock:
            context = self.defaults.get(name)
            if context in self.contexts:
                return self.contexts[context]
            kernel = Kernel(str(uuid.uuid4()), name, DEFAULT_CWD)
            self.contexts[kernel.id] = kernel
            self.defaults[name] = kernel.id
            return kernel

    def get(self, context_id: str) -> Kernel:
        with self.lock:
            kernel = self.contexts.get(context_id)
        if kernel is None:
            raise RequestError(HTTPStatus.NOT_FOUND, f"context {context_id!r} not found")
        return kernel

    def remove(self, context_id: str) -> None:
        kernel = self.get(context_id)
        with self.lock:
            self.contexts.pop(context_id, None)
        kernel.stop()

    def described(self) -> list[dict[str, str]]:
        with self.lock:
            return [kernel.describe() for kernel in self.contexts.values()]


def sandbox_envs(access_token: str | None) -> dict[str, str]:
    """The sandbox's environment variables (``Sandbox.create(envs=...)``), which envd was given
    after this service started: asked for at every cell, with the envd access token the SDK
    sends along (a secured sandbox's envd answers only with it)."""
    headers = {"X-Access-Token": access_token} if access_token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(ENVD_ENVS, headers=headers), timeout=2) as answer:
            envs = json.load(answer)
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in envs.items() if isinstance(v, str)} if isinstance(envs, dict) else {}


def _language(language: str | None) -> str:
    name = LANGUAGES.get((language or "python").lower())
    if name is None:
        raise RequestError(
            HTTPStatus.BAD_REQUEST,
            f"language {language!r} is not available in this template (available: python)",
        )
    return name


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    kernels: Kernels

    def log_message(self, format: str, *args: Any) -> None:
        return  # the sandbox has no one to read an access log

    def do_GET(self) -> None:
        self._dispatch(
            {
                ("/health",): lambda: self._json(HTTPStatus.OK, {"status": "ok"}),
                ("/contexts",): lambda: self._json(HTTPStatus.OK, self.kernels.described()),
            }
        )

    def do_POST(self) -> None:
        parts = self.path.split("?")[0].strip("/").split("/")
        if parts == ["execute"]:
            return self._guard(self._execute)
        if parts == ["contexts"]:
            return self._guard(self._create)
        if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart":
            return self._guard(lambda: self._restart(parts[1]))
        self._guard(self._not_found)

    def do_DELETE(self) -> None:
        parts = self.path.split("?")[0].strip("/").split("/")
        if len(parts) == 2 and parts[0] == "contexts":
            return self._guard(lambda: self._remove(parts[1]))
        self._guard(self._not_found)

    def _dispatch(self, routes: dict[Any, Any]) -> None:
        handler = routes.get((self.path.split("?")[0].rstrip("/") or "/",))
        self._guard(handler or self._not_found)

    def _guard(self, handler: Any) -> None:
        try:
            handler()
        except RequestError as exc:
            self._json(exc.status, {"code": exc.status, "message": str(exc)})

    def _not_found(self) -> None:
        raise RequestError(HTTPStatus.NOT_FOUND, f"no route {self.command} {self.path}")

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "request body too large")
        raw = self.rfile.read(length) if length else b"{}"
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            raise RequestError(HTTPStatus.BAD_REQUEST, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise RequestError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
        return body

    def _json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _execute(self) -> None:
        body = self._body()
        code, env = body.get("code"), body.get("env_vars") or {}
        if not isinstance(code, str):
            raise RequestError(HTTPStatus.BAD_REQUEST, "'code' must be a string")
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise RequestError(HTTPStatus.BAD_REQUEST, "'env_vars' must map names to strings")
        if body.get("context_id") and body.get("language"):
            raise RequestError(HTTPStatus.BAD_REQUEST, "give a context or a language, not both")
        context_id = body.get("context_id")
        kernel = self.kernels.get(context_id) if context_id else self.kernels.default(body.get("language"))
        envs = {**sandbox_envs(self.headers.get("X-Access-Token")), **env}
        lines = kernel.execute({"code": code, "env_vars": envs}, self.connection)
        first = next(lines, None)  # errors before the first line are still a status
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for line in [first] if first is not None else []:
                self._chunk(line)
            for line in lines:
                self._chunk(line)
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            lines.close()  # the client left; the kernel saw it or will at its next line
            self.close_connection = True

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _create(self) -> None:
        body = self._body()
        cwd = body.get("cwd")
        if cwd is not None and (not isinstance(cwd, str) or not os.path.isdir(cwd)):
            raise RequestError(HTTPStatus.BAD_REQUEST, f"cwd {cwd!r} is not a directory")
        self._json(HTTPStatus.OK, self.kernels.create(body.get("language"), cwd).describe())

    def _restart(self, context_id: str) -> None:
        self.kernels.get(context_id).restart()
        self._json(HTTPStatus.OK, {"status": "ok"})

    def _remove(self, context_id: str) -> None:
        self.kernels.remove(context_id)
        self.send_response(HTTPStatus.NO_CONTENT)
        self.send_header("Content-Length", "0")
        self.end_headers()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=PORT)
    args = parser.parse_args()
    Handler.kernels = Kernels()
    Handler.kernels.default("python")  # warm: the template's snapshot holds a ready kernel
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
