"""`process.Process` service: spawning commands as users, PTYs, output fan-out, input and signals.

It stays one module over 600 lines: every call of the service works on the one table of running
processes it keeps, and the guest loads it whole at boot either way.
"""

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
from .inputs import (
    c_string,
    environment,
    flag,
    invalid,
    obj,
    optional_text,
    string_map,
    strings,
    text,
    uint32,
)
from .state import State
from .users import User, request_user, resolve_path

log = logging.getLogger(__name__)

STD_CHUNK = 32 * 1024
PTY_CHUNK = 16 * 1024
# Output chunks a stream subscriber may have queued before the process's output stops being read:
# the bound on what envd holds per stream (the rest waits in the pipe, then blocks the writer).
QUEUE_DEPTH = 8
# Output still read after the process exited (a background child may keep the pipe open and busy).
DRAIN_LIMIT = 4 * 1024 * 1024
RETAIN_ENDED = 64
# What E2B's envd gives the processes it starts, so the guest's OOM killer picks them before
# envd (which init runs at -1000).
CHILD_OOM_SCORE_ADJ = 100
MAX_WINSIZE = 0xFFFF
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The SDKs start every command and terminal as `/bin/bash -l -c ...` / `-i -l`. An image without
# bash (busybox, alpine-like, distroless) runs them with its POSIX shell, which takes those flags.
BASH = "/bin/bash"
POSIX_SHELL = "/bin/sh"
# proto `Signal` values envd acts on, by enum name and number.
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
    raw = str(value)
    try:
        return base64.b64decode(
            raw + "=" * (-len(raw) % 4), altchars=b"-_" if "-" in raw or "_" in raw else None
        )
    except ValueError:
        raise ConnectError("invalid_argument", "input is not valid base64") from None


def _winsize(size: Message | None) -> tuple[int, int]:
    rows = uint32(size, "rows") or 24
    cols = uint32(size, "cols") or 80
    if rows > MAX_WINSIZE or cols > MAX_WINSIZE:
        raise invalid(f"pty size must be at most {MAX_WINSIZE} rows and columns")
    return rows, cols


def _set_winsize(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _program(cmd: str) -> str:
    """The program to exec for `cmd`: the image's /bin/sh where the SDK asks for a missing bash."""
    if cmd != BASH or os.path.exists(BASH):
        return cmd
    if os.path.exists(POSIX_SHELL):
        return POSIX_SHELL
    raise ConnectError(
        "failed_precondition",
        f"this sandbox's image has no shell ({BASH} or {POSIX_SHELL}) to run the command in",
    )


def _user_spec(user: User | None) -> str:
    """aenv-exec's USER argument: the ids to take ("-": keep envd's). Groups are looked up here,
    since the static helper has no NSS."""
    if user is None:
        return "-"
    return f"{user.uid}:{user.gid}:{','.join(str(g) for g in user.groups)}"


def _spawn_error(report: bytes, program: str) -> OSError:
    """The OSError aenv-exec reported as "STEP ERRNO" (the exec's names the program, as Popen's)."""
    step, _, number = report.decode(errors="replace").partition(" ")
    code = int(number) if number.isdigit() else 0
    if step == "exec":
        return OSError(code, os.strerror(code), program)
    return OSError(code, f"{os.strerror(code)} ({step})")


def _read_report(fd: int) -> bytes:
    """All aenv-exec writes to its report pipe: nothing once the command's exec closed it."""
    chunks = []
    while chunk := os.read(fd, 512):
        chunks.append(chunk)
    return b"".join(chunks)


async def _fd_ready(fd: int, *, write: bool = False, unless: asyncio.Future[None] | None = None) -> None:
    """Wait until `fd` is readable (or writable), or until `unless` is done.

    One future and plain callbacks, no task and no `asyncio.wait`: every command waits here for
    its exit and its output. With the other changes to the same end (no `gather`, no `wait_for`),
    a `/bin/true` Start took 8.9 turns of envd's event loop where it took 13.6 (host, 300 runs)."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()

    def wake(_: object = None) -> None:
        if not ready.done():
            ready.set_result(None)

    (loop.add_writer if write else loop.add_reader)(fd, wake)
    if unless is not None:
        unless.add_done_callback(wake)
    try:
        await ready
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)
        if unless is not None:
            unless.remove_done_callback(wake)


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
    """One spawned process: owns its pipes/PTY and fans its output out to every connected stream.

    Output flows with backpressure: a chunk is read from the pipe only when every subscriber has
    room for it (fewer than QUEUE_DEPTH queued), and subscribers only take chunks as fast as their
    HTTP response is sent. A slow or stalled client therefore leaves the output in the pipe (and
    blocks the writer, as a full pipe does), never in envd's memory. Without any subscriber the
    output is read and dropped, as E2B's envd does, so a background command never blocks."""

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
        self.room = asyncio.Event()
        self.room.set()
        self.exited: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.end: Message | None = None
        self.write_lock = asyncio.Lock()
        self.timer: asyncio.TimerHandle | None = None
        self.timed_out = False

    def subscribe(self) -> asyncio.Queue[Message]:
        q: asyncio.Queue[Message] = asyncio.Queue()
        self.subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[Message]) -> None:
        self.subscribers.discard(q)
        self.taken()

    def taken(self) -> None:
        """A subscriber consumed a message (or left): output may flow again once all have room."""
        if all(q.qsize() < QUEUE_DEPTH for q in self.subscribers):
            self.room.set()

    async def wait_room(self) -> None:
        while not all(q.qsize() < QUEUE_DEPTH for q in self.subscribers):
            self.room.clear()
            await self.room.wait()

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
        async with self.write_lock:
            view = memoryview(data)
            while view:
                try:
                    written = os.write(fd, view)
                except BlockingIOError:
                    await _fd_ready(fd, write=True)
                    continue
                except OSError as e:
                    raise ConnectError("internal", f"error writing to process {self.pid}: {e}") from None
                view = view[written:]

    async def pump(self, fd: int, kind: str) -> None:
        """Forward one output stream until EOF, or until the exited process's leftovers are drained."""
        size = PTY_CHUNK if kind == "pty" else STD_CHUNK
        drained = 0
        try:
            while drained <= DRAIN_LIMIT:
                await self.wait_room()
                try:
                    data = os.read(fd, size)
                except BlockingIOError:
                    if self.exited.done():
                        return
                    await _fd_ready(fd, unless=self.exited)
                    continue
                except OSError:  # EIO on a PTY master once the slave side is gone
                    return
                if not data:
                    return
                if self.exited.done():
                    drained += len(data)
                self.publish({"data": {kind: _b64(data)}})
                await asyncio.sleep(0)  # a producer faster than envd must not starve the loop
        finally:
            if fd == self.pty_master:  # input must never go to whatever reuses the number
                self.pty_master = None
            os.close(fd)

    async def wait_exit(self) -> int:
        """The exit status, awaited through a pidfd (a thread where the kernel has none)."""
        try:
            pidfd = os.pidfd_open(self.pid)
        except OSError:
            return await asyncio.to_thread(self.popen.wait)
        try:
            await _fd_ready(pidfd)
            return self.popen.wait()
        finally:
            os.close(pidfd)

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
        self._supervisors: set[asyncio.Task[None]] = set()

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
        pid = uint32(selector, "pid") if field(selector, "pid") is not None else None
        tag = optional_text(selector, "tag")
        if pid is None and tag is None:
            raise invalid("process selector needs a pid or a tag")
        pools = [self.running, self.ended] if include_ended else [self.running]
        for pool in pools:
            if pid is not None:
                proc = pool.get(pid)
                if proc is not None:
                    return proc
            else:
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
        config = obj(req, "process") or {}
        cmd = c_string(text(config, "cmd"), "process.cmd")
        if not cmd:
            raise invalid("process.cmd is required")
        program = _program(cmd)
        args = strings(config, "args", "process.args")
        envs = string_map(field(config, "envs"), "process.envs")
        cwd = self._cwd(optional_text(config, "cwd"), user)
        pty = obj(req, "pty")
        winsize = _winsize(obj(pty, "size")) if pty is not None else None
        want_stdin = flag(req, "stdin")
        tag = optional_text(req, "tag")
        env = environment(self._environment(user, envs))

        as_root = os.geteuid() == 0
        to_close: list[int] = []
        outputs: dict[int, str] = {}
        stdin_fd = master = None
        try:
            if winsize is not None:
                master, slave = os.openpty()
                to_close.append(slave)
                _set_winsize(master, *winsize)
                if as_root:
                    os.fchown(slave, user.uid, -1)
                stdio: dict[str, Any] = {"stdin": slave, "stdout": slave, "stderr": slave}
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
            popen = self._exec(program, args, env, cwd, user if as_root else None, winsize is not None, stdio)
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            for fd in [*outputs, *([stdin_fd] if stdin_fd is not None else [])]:
                os.close(fd)
            raise invalid(f"failed to start process: {e}") from None
        finally:
            for fd in to_close:
                os.close(fd)
        if stdin_fd is not None:
            os.set_blocking(stdin_fd, False)
        for fd in outputs:
            os.set_blocking(fd, False)
        cfg: Message = {"cmd": cmd, "args": args, "envs": envs, "cwd": cwd}
        proc = Proc(popen, cfg, tag, master, stdin_fd, outputs)
        self.running[proc.pid] = proc
        return proc

    def _exec(
        self,
        program: str,
        args: list[str],
        env: dict[str, str],
        cwd: str,
        user: User | None,
        ctty: bool,
        stdio: dict[str, Any],
    ) -> subprocess.Popen[bytes]:
        """Start `program` through aenv-exec, which sets its OOM score, `user` and terminal.

        Without a preexec function or ids to change, CPython starts the helper with vfork. Before,
        envd's fork copied its page tables and the Python preexec function then faulted in every
        page it touched. Under TCG, `bash -c true` through the node's proxy took 52-58 ms before
        and 32-37 ms now (warm, as root or a user), and each child of a fork into 16 used 50-100 ms
        less QEMU CPU for its first command. Raises OSError when the helper or the program cannot
        be started, with the helper already reaped."""
        report, report_w = os.pipe()
        try:
            try:
                popen = subprocess.Popen(
                    [self.state.exec_helper, str(report_w), str(CHILD_OOM_SCORE_ADJ), _user_spec(user),
                     "1" if ctty else "0", program, *args],
                    env=env, cwd=cwd, start_new_session=True, pass_fds=(report_w,), **stdio,
                )  # fmt: skip
            finally:
                os.close(report_w)
            failure = _read_report(report)
        finally:
            os.close(report)
        if failure:
            popen.wait()
            raise _spawn_error(failure, program)
        return popen

    def _watch(self, proc: Proc, lifetime: float | None) -> None:
        """Start forwarding output and waiting for the exit (in tasks of their own)."""
        task = asyncio.get_running_loop().create_task(self._supervise(proc))
        self._supervisors.add(task)
        task.add_done_callback(self._supervisors.discard)
        if lifetime:
            proc.timer = asyncio.get_running_loop().call_later(lifetime, self._expire, proc)

    @staticmethod
    def _expire(proc: Proc) -> None:
        """The Start deadline is the process lifetime: kill it, independent of any stream."""
        proc.timed_out = True
        proc.signal(signal.SIGKILL)

    async def _supervise(self, proc: Proc) -> None:
        """Forward output until the process exited and its output is drained, close its I/O (as Go's
        Wait does), then publish `end` after the last output."""
        pumps = [asyncio.ensure_future(proc.pump(fd, kind)) for fd, kind in proc.outputs.items()]
        try:
            returncode = await proc.wait_exit()
            proc.exited.set_result(None)
            for pump in pumps:  # not gather: pumps done by now (the usual case) cost no loop turn
                await pump
        finally:
            for pump in pumps:
                pump.cancel()
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
                    async with asyncio.timeout(wait):  # no task per message, as wait_for makes
                        msg = await q.get()
                except TimeoutError:
                    if deadline is not None and loop.time() >= deadline:
                        raise ConnectError("deadline_exceeded", "the operation timed out") from None
                    yield {"event": {"keepalive": {}}}
                    continue
                proc.taken()
                if "end" in msg["event"]:
                    if proc.timed_out and deadline is not None:
                        raise ConnectError("deadline_exceeded", "the operation timed out")
                    yield msg
                    return
                yield msg
        finally:
            if q is not None:
                proc.unsubscribe(q)

    async def start(self, request: web.Request, req: Message) -> AsyncIterator[Message]:
        user = request_user(request, self.state)
        proc = self.spawn(req, user)
        q = proc.subscribe()
        self._watch(proc, timeout_seconds(request))
        log.info("started pid %d as %s: %s %s", proc.pid, user.name, proc.config["cmd"], proc.config["args"])
        async for msg in self._events(request, proc, q):
            yield msg

    async def connect(self, request: web.Request, req: Message) -> AsyncIterator[Message]:
        proc = self._select(obj(req, "process"), include_ended=True)
        q = None if proc.end is not None else proc.subscribe()
        async for msg in self._events(request, proc, q):
            yield msg

    async def list(self, request: web.Request, req: Message) -> Message:
        return {"processes": [p.info() for p in self.running.values()]}

    async def _send(self, proc: Proc, data_input: Message | None) -> None:
        if data_input is None:
            return
        if "pty" in data_input:
            if proc.pty_master is None:
                raise ConnectError("failed_precondition", f"process {proc.pid} has no PTY")
            await proc.write(_unb64(text(data_input, "pty")))
        elif "stdin" in data_input:
            await proc.write(_unb64(text(data_input, "stdin")))

    async def send_input(self, request: web.Request, req: Message) -> Message:
        proc = self._select(obj(req, "process"))
        await self._send(proc, obj(req, "input"))
        return {}

    async def stream_input(self, request: web.Request, messages: AsyncIterator[Message]) -> Message:
        proc: Proc | None = None
        async for msg in messages:
            if "start" in msg:
                proc = self._select(obj(obj(msg, "start"), "process"))
            elif "data" in msg:
                if proc is None:
                    raise ConnectError("failed_precondition", "first message must be start")
                await self._send(proc, obj(obj(msg, "data"), "input"))
        return {}

    async def send_signal(self, request: web.Request, req: Message) -> Message:
        proc = self._select(obj(req, "process"))
        value = field(req, "signal")
        sig = SIGNALS.get(value) if isinstance(value, str | int) and not isinstance(value, bool) else None
        if sig is None:
            raise invalid(f"invalid signal: {str(value)[:64]} (SIGNAL_SIGKILL or SIGNAL_SIGTERM)")
        proc.signal(sig)
        return {}

    async def close_stdin(self, request: web.Request, req: Message) -> Message:
        self._select(obj(req, "process")).close_stdin()
        return {}

    async def update(self, request: web.Request, req: Message) -> Message:
        proc = self._select(obj(req, "process"))
        pty = obj(req, "pty")
        if pty is not None:
            if proc.pty_master is None:
                raise ConnectError("failed_precondition", f"process {proc.pid} has no PTY")
            _set_winsize(proc.pty_master, *_winsize(obj(pty, "size")))
        return {}

    def shutdown(self) -> None:
        for proc in list(self.running.values()):
            proc.signal(signal.SIGKILL)
