"""`process.Process` service: spawning commands as users, PTYs, output fan-out, input and signals."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import logging
import os
import signal
import struct
import subprocess
import termios
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from .connect import (
    ConnectError,
    Message,
    client_stream,
    field,
    keepalive_seconds,
    server_stream,
    timeout_seconds,
    unary,
)
from .state import State
from .users import User, request_user, resolve_path

log = logging.getLogger(__name__)

STD_CHUNK = 32 * 1024
PTY_CHUNK = 16 * 1024
DRAIN_LIMIT = 4 * 1024 * 1024
RETAIN_ENDED = 64
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SIGNALS = {
    "SIGNAL_SIGKILL": signal.SIGKILL,
    "SIGNAL_SIGTERM": signal.SIGTERM,
    9: signal.SIGKILL,
    15: signal.SIGTERM,
}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(value: Any) -> bytes:
    if not value:
        return b""
    text = str(value)
    try:
        return base64.b64decode(
            text + "=" * (-len(text) % 4), altchars=b"-_" if "-" in text or "_" in text else None
        )
    except ValueError:
        raise ConnectError("invalid_argument", "input is not valid base64") from None


def _set_winsize(fd: int, size: Message | None) -> None:
    rows = int(field(size, "rows", default=0) or 24)
    cols = int(field(size, "cols", default=0) or 80)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _acquire_ctty() -> None:
    """Child-side: make the PTY slave (already on fd 0) the controlling terminal of the new session."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _status(returncode: int) -> tuple[Message, str | None]:
    """EndEvent fields, mimicking Go's ProcessState.String() as the reference envd reports it."""
    if returncode >= 0:
        status = f"exit status {returncode}"
        end: Message = {"exitCode": returncode, "exited": True, "status": status}
        return end, (status if returncode else None)
    try:
        name = (signal.strsignal(-returncode) or f"signal {-returncode}").lower()
    except ValueError:
        name = f"signal {-returncode}"
    status = f"signal: {name}"
    return {"exitCode": -1, "exited": False, "status": status}, status


class Proc:
    """One spawned process: owns its pipes/PTY, fans output out to every connected stream."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        config: Message,
        tag: str | None,
        pty_master: int | None,
        stdin_fd: int | None,
        outputs: dict[int, str],
    ) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.config = config
        self.tag = tag
        self.pty_master = pty_master
        self.stdin_fd = stdin_fd
        self.outputs = outputs
        self.subscribers: set[asyncio.Queue[Message]] = set()
        self.end: Message | None = None
        self.write_lock = asyncio.Lock()
        self.timer: asyncio.TimerHandle | None = None
        self.waiter: asyncio.Task[None] | None = None
        self.timed_out = False

    def subscribe(self) -> asyncio.Queue[Message]:
        q: asyncio.Queue[Message] = asyncio.Queue()
        self.subscribers.add(q)
        return q

    def publish(self, event: Message) -> None:
        msg = {"event": event}
        for q in self.subscribers:
            q.put_nowait(msg)

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except OSError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    async def write(self, data: bytes) -> None:
        """Write input without blocking the event loop when the pipe/PTY buffer is full."""
        fd = self.pty_master if self.pty_master is not None else self.stdin_fd
        if fd is None:
            raise ConnectError("failed_precondition", f"stdin of process {self.pid} is not open")
        loop = asyncio.get_running_loop()
        async with self.write_lock:
            view = memoryview(data)
            while view:
                try:
                    written = os.write(fd, view)
                except BlockingIOError:
                    ready = loop.create_future()
                    loop.add_writer(fd, ready.set_result, None)
                    try:
                        await ready
                    finally:
                        loop.remove_writer(fd)
                    continue
                except OSError as e:
                    raise ConnectError("internal", f"error writing to process {self.pid}: {e}") from None
                view = view[written:]

    def close_stdin(self) -> None:
        if self.pty_master is not None:
            raise ConnectError("failed_precondition", "cannot close stdin of a PTY process; send Ctrl+D")
        if self.stdin_fd is not None:
            os.close(self.stdin_fd)
            self.stdin_fd = None

    def info(self) -> Message:
        out: Message = {"config": self.config, "pid": self.pid}
        if self.tag is not None:
            out["tag"] = self.tag
        return out


class ProcessService:
    """Registry of processes plus the RPC handlers of `process.Process`."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.running: dict[int, Proc] = {}
        self.ended: dict[int, Proc] = {}

    def routes(self) -> list[web.RouteDef]:
        base = "/process.Process/"
        return [
            web.post(base + "Start", server_stream(self.start)),
            web.post(base + "Connect", server_stream(self.connect)),
            web.post(base + "List", unary(self.list)),
            web.post(base + "SendInput", unary(self.send_input)),
            web.post(base + "StreamInput", client_stream(self.stream_input)),
            web.post(base + "SendSignal", unary(self.send_signal)),
            web.post(base + "CloseStdin", unary(self.close_stdin)),
            web.post(base + "Update", unary(self.update)),
        ]

    # -- lookup -------------------------------------------------------------------------------------

    def _select(self, selector: Message | None, include_ended: bool = False) -> Proc:
        pid = field(selector, "pid")
        tag = field(selector, "tag")
        pools = [self.running, self.ended] if include_ended else [self.running]
        for pool in pools:
            if pid is not None:
                proc = pool.get(int(pid))
                if proc is not None:
                    return proc
            elif tag is not None:
                for proc in pool.values():
                    if proc.tag == tag:
                        return proc
        what = f"pid {pid}" if pid is not None else f"tag '{tag}'"
        raise ConnectError("not_found", f"process with {what} not found")

    # -- spawning -----------------------------------------------------------------------------------

    def _environment(self, user: User, extra: dict[str, str]) -> dict[str, str]:
        env = {
            "PATH": os.environ.get("PATH") or DEFAULT_PATH,
            "HOME": user.home,
            "USER": user.name,
            "LOGNAME": user.name,
            "SHELL": user.shell,
        }
        env.update(self.state.env_vars)
        env.update(extra)
        return env

    def _cwd(self, requested: str | None, user: User) -> str:
        if requested:
            cwd = resolve_path(requested, user, None)
        else:
            workdir = self.state.default_workdir
            cwd = workdir if workdir and os.path.isdir(workdir) else user.home
        if not os.path.isdir(cwd):
            raise ConnectError("invalid_argument", f"cwd '{cwd}' does not exist")
        return cwd

    def spawn(self, req: Message, user: User) -> Proc:
        config = field(req, "process") or {}
        cmd = field(config, "cmd") or ""
        if not cmd:
            raise ConnectError("invalid_argument", "process.cmd is required")
        args = [str(a) for a in field(config, "args") or []]
        envs = {str(k): str(v) for k, v in (field(config, "envs") or {}).items()}
        cwd = self._cwd(field(config, "cwd"), user)
        pty = field(req, "pty")
        want_stdin = field(req, "stdin")
        tag = field(req, "tag")

        kwargs: dict[str, Any] = {}
        if os.geteuid() == 0:
            kwargs.update(user=user.uid, group=user.gid, extra_groups=user.groups)
        to_close: list[int] = []
        outputs: dict[int, str] = {}
        stdin_fd = master = None
        try:
            if pty is not None:
                master, slave = os.openpty()
                to_close.append(slave)
                _set_winsize(master, field(pty, "size"))
                if os.geteuid() == 0:
                    os.fchown(slave, user.uid, -1)
                stdio: dict[str, Any] = {"stdin": slave, "stdout": slave, "stderr": slave}
                kwargs["preexec_fn"] = _acquire_ctty
                outputs[master] = "pty"
            else:
                out_r, out_w = os.pipe()
                err_r, err_w = os.pipe()
                to_close += [out_w, err_w]
                outputs[out_r] = "stdout"
                outputs[err_r] = "stderr"
                stdio = {"stdout": out_w, "stderr": err_w, "stdin": subprocess.DEVNULL}
                if want_stdin is None or want_stdin:
                    in_r, stdin_fd = os.pipe()
                    to_close.append(in_r)
                    stdio["stdin"] = in_r
            popen = subprocess.Popen(
                [cmd, *args],
                env=self._environment(user, envs),
                cwd=cwd,
                start_new_session=True,
                **stdio,
                **kwargs,
            )
        except (OSError, subprocess.SubprocessError) as e:
            for fd in [*outputs, *([stdin_fd] if stdin_fd is not None else [])]:
                os.close(fd)
            raise ConnectError("invalid_argument", f"failed to start process: {e}") from None
        finally:
            for fd in to_close:
                os.close(fd)
        if stdin_fd is not None:
            os.set_blocking(stdin_fd, False)
        cfg: Message = {"cmd": cmd, "args": args, "envs": envs, "cwd": cwd}
        proc = Proc(popen, cfg, tag, master, stdin_fd, outputs)
        self.running[proc.pid] = proc
        return proc

    def _watch(self, proc: Proc, lifetime: float | None) -> None:
        """Start forwarding output and reaping; must run in the same loop tick as the first subscribe."""
        loop = asyncio.get_running_loop()
        for fd, kind in proc.outputs.items():
            os.set_blocking(fd, False)
            loop.add_reader(fd, self._on_output, proc, fd, kind)
        try:
            pidfd = os.pidfd_open(proc.pid)
        except OSError:
            proc.waiter = loop.create_task(self._wait_thread(proc))
        else:
            loop.add_reader(pidfd, self._on_pidfd, proc, pidfd)
        if lifetime:
            proc.timer = loop.call_later(lifetime, self._expire, proc)

    @staticmethod
    def _expire(proc: Proc) -> None:
        """The Start deadline is the process lifetime: kill it, independent of any stream."""
        proc.timed_out = True
        proc.signal(signal.SIGKILL)

    def _read(self, proc: Proc, fd: int, kind: str) -> int:
        """Read one chunk and publish it: bytes read, 0 if nothing is available, -1 once the stream ended."""
        try:
            data = os.read(fd, PTY_CHUNK if kind == "pty" else STD_CHUNK)
        except BlockingIOError:
            return 0
        except OSError:  # EIO on a PTY master once the slave side is gone
            data = b""
        if not data:
            self._close_output(proc, fd)
            return -1
        proc.publish({"data": {kind: _b64(data)}})
        return len(data)

    def _on_output(self, proc: Proc, fd: int, kind: str) -> None:
        self._read(proc, fd, kind)

    def _close_output(self, proc: Proc, fd: int) -> None:
        if proc.outputs.pop(fd, None) is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    def _on_pidfd(self, proc: Proc, pidfd: int) -> None:
        asyncio.get_running_loop().remove_reader(pidfd)
        os.close(pidfd)
        self._finish(proc, proc.popen.wait())

    async def _wait_thread(self, proc: Proc) -> None:
        self._finish(proc, await asyncio.to_thread(proc.popen.wait))

    def _finish(self, proc: Proc, returncode: int) -> None:
        """Drain what the process wrote before exiting, close its I/O (as Go's Wait does), publish `end`."""
        for fd, kind in list(proc.outputs.items()):
            budget = DRAIN_LIMIT
            while budget > 0:
                n = self._read(proc, fd, kind)
                if n <= 0:
                    break
                budget -= n
            self._close_output(proc, fd)
        if proc.stdin_fd is not None:
            os.close(proc.stdin_fd)
            proc.stdin_fd = None
        if proc.timer is not None:
            proc.timer.cancel()
        end, error = _status(returncode)
        if error:
            end["error"] = error
        proc.end = end
        proc.publish({"end": end})
        self.running.pop(proc.pid, None)
        self.ended[proc.pid] = proc
        while len(self.ended) > RETAIN_ENDED:
            self.ended.pop(next(iter(self.ended)))

    # -- RPCs ---------------------------------------------------------------------------------------

    async def _events(
        self, request: web.Request, proc: Proc, q: asyncio.Queue[Message] | None
    ) -> AsyncIterator[Message]:
        """Shared Start/Connect stream: start, live data, idle keepalives, end; bounded by the deadline."""
        loop = asyncio.get_running_loop()
        keepalive = keepalive_seconds(request)
        timeout = timeout_seconds(request)
        deadline = loop.time() + timeout if timeout else None
        try:
            yield {"event": {"start": {"pid": proc.pid}}}
            if q is None:
                yield {"event": {"end": proc.end}}
                return
            while True:
                wait = keepalive
                if deadline is not None:
                    wait = min(wait, deadline - loop.time())
                    if wait <= 0:
                        raise ConnectError("deadline_exceeded", "the operation timed out")
                try:
                    msg = await asyncio.wait_for(q.get(), wait)
                except TimeoutError:
                    if deadline is not None and loop.time() >= deadline:
                        raise ConnectError("deadline_exceeded", "the operation timed out") from None
                    yield {"event": {"keepalive": {}}}
                    continue
                if "end" in msg["event"]:
                    if proc.timed_out and deadline is not None:
                        raise ConnectError("deadline_exceeded", "the operation timed out")
                    yield msg
                    return
                yield msg
        finally:
            if q is not None:
                proc.subscribers.discard(q)

    async def start(self, request: web.Request, req: Message) -> AsyncIterator[Message]:
        user = request_user(request, self.state)
        proc = self.spawn(req, user)
        q = proc.subscribe()
        self._watch(proc, timeout_seconds(request))
        log.info("started pid %d as %s: %s %s", proc.pid, user.name, proc.config["cmd"], proc.config["args"])
        async for msg in self._events(request, proc, q):
            yield msg

    async def connect(self, request: web.Request, req: Message) -> AsyncIterator[Message]:
        proc = self._select(field(req, "process"), include_ended=True)
        q = None if proc.end is not None else proc.subscribe()
        async for msg in self._events(request, proc, q):
            yield msg

    async def list(self, request: web.Request, req: Message) -> Message:
        return {"processes": [p.info() for p in self.running.values()]}

    async def _send(self, proc: Proc, data_input: Message | None) -> None:
        if not isinstance(data_input, dict):
            return
        if "pty" in data_input:
            if proc.pty_master is None:
                raise ConnectError("failed_precondition", f"process {proc.pid} has no PTY")
            await proc.write(_unb64(data_input["pty"]))
        elif "stdin" in data_input:
            await proc.write(_unb64(data_input["stdin"]))

    async def send_input(self, request: web.Request, req: Message) -> Message:
        proc = self._select(field(req, "process"))
        await self._send(proc, field(req, "input"))
        return {}

    async def stream_input(self, request: web.Request, messages: AsyncIterator[Message]) -> Message:
        proc: Proc | None = None
        async for msg in messages:
            if "start" in msg:
                proc = self._select(field(msg["start"], "process"))
            elif "data" in msg:
                if proc is None:
                    raise ConnectError("failed_precondition", "first message must be start")
                await self._send(proc, field(msg["data"], "input"))
        return {}

    async def send_signal(self, request: web.Request, req: Message) -> Message:
        proc = self._select(field(req, "process"))
        sig = SIGNALS.get(field(req, "signal"))
        if sig is None:
            raise ConnectError("unimplemented", f"invalid signal: {field(req, 'signal')}")
        proc.signal(sig)
        return {}

    async def close_stdin(self, request: web.Request, req: Message) -> Message:
        self._select(field(req, "process")).close_stdin()
        return {}

    async def update(self, request: web.Request, req: Message) -> Message:
        proc = self._select(field(req, "process"))
        pty = field(req, "pty")
        if pty is not None:
            if proc.pty_master is None:
                raise ConnectError("failed_precondition", f"process {proc.pid} has no PTY")
            _set_winsize(proc.pty_master, field(pty, "size"))
        return {}

    def shutdown(self) -> None:
        for proc in list(self.running.values()):
            proc.signal(signal.SIGKILL)
