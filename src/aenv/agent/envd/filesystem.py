"""`filesystem.Filesystem` service: stat/list/mkdir/move/remove as the requesting user, plus watchers."""

from __future__ import annotations

import asyncio
import errno
import itertools
import os
import stat
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from aiohttp import web

from .connect import (
    ConnectError,
    Message,
    keepalive_seconds,
    os_error,
    server_stream,
    timeout_seconds,
    unary,
)
from .entry import entry_info
from .inputs import flag, text, uint32
from .state import State
from .users import User, request_user, resolve_path, run_as
from .watcher import Watcher

T = TypeVar("T")
MAX_BUFFERED_EVENTS = 100_000
NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "ceph", "glusterfs", "sshfs")


def _mount_fstype(path: str) -> str:
    """Filesystem type of the mount containing `path` (longest matching mount point)."""
    best, fstype = "", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fstype = mnt, parts[2]
    except OSError:
        pass
    return fstype


def _is_network_mount(path: str) -> bool:
    fstype = _mount_fstype(os.path.realpath(path))
    return fstype in NETWORK_FS or fstype.startswith("fuse")


def _list(root: str, depth: int) -> list[Message]:
    """Entries below `root` (following `root` if it is a symlink) down to `depth` levels, lexical order."""
    st = os.stat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise ConnectError("invalid_argument", f"path '{root}' is not a directory")
    out: list[Message] = []

    def walk(real: str, shown: str, level: int) -> None:
        with os.scandir(real) as it:
            items = sorted(it, key=lambda e: e.name)
        for item in items:
            path = os.path.join(shown, item.name)
            try:
                out.append(entry_info(item.path, item.name) | {"path": path})
            except OSError:
                continue
            if level < depth and item.is_dir(follow_symlinks=False):
                try:
                    walk(item.path, path, level + 1)
                except OSError:
                    continue

    walk(root, root, 1)
    return out


def _make_dir(path: str) -> Message:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        os.makedirs(path)
        return entry_info(path)
    if stat.S_ISDIR(st.st_mode):
        raise ConnectError("already_exists", f"directory '{path}' already exists")
    raise ConnectError("invalid_argument", f"path '{path}' already exists and is not a directory")


def _move(src: str, dst: str) -> Message:
    os.lstat(src)
    os.makedirs(os.path.dirname(dst) or "/", exist_ok=True)
    try:
        os.rename(src, dst)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        import shutil

        shutil.move(src, dst)
    return entry_info(dst)


def _remove(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        import shutil

        shutil.rmtree(path)
    else:
        os.unlink(path)


class _BufferedWatcher:
    """A CreateWatcher watcher: events accumulate until GetWatcherEvents drains them."""

    def __init__(self) -> None:
        self.events: list[Message] = []
        self.watcher: Watcher | None = None

    def push(self, event: Message) -> None:
        if len(self.events) < MAX_BUFFERED_EVENTS:
            self.events.append(event)


class FilesystemService:
    def __init__(self, state: State) -> None:
        self.state = state
        self.watchers: dict[str, _BufferedWatcher] = {}
        self._ids = itertools.count(1)

    def routes(self) -> list[web.RouteDef]:
        base = "/filesystem.Filesystem/"
        return [
            web.post(base + "Stat", unary(self.stat)),
            web.post(base + "MakeDir", unary(self.make_dir)),
            web.post(base + "Move", unary(self.move)),
            web.post(base + "ListDir", unary(self.list_dir)),
            web.post(base + "Remove", unary(self.remove)),
            web.post(base + "WatchDir", server_stream(self.watch_dir)),
            web.post(base + "CreateWatcher", unary(self.create_watcher)),
            web.post(base + "GetWatcherEvents", unary(self.get_watcher_events)),
            web.post(base + "RemoveWatcher", unary(self.remove_watcher)),
        ]

    def _user_path(self, request: web.Request, req: Message, name: str = "path") -> tuple[User, str]:
        user = request_user(request, self.state)
        return user, resolve_path(text(req, name), user, self.state.default_workdir)

    async def _as(self, user: User, what: str, fn: Callable[[], T]) -> T:
        try:
            return await asyncio.to_thread(run_as, user, fn)
        except OSError as e:
            raise os_error(e, what) from None

    async def stat(self, request: web.Request, req: Message) -> Message:
        user, path = self._user_path(request, req)
        return {"entry": await self._as(user, f"cannot stat '{path}'", lambda: entry_info(path))}

    async def make_dir(self, request: web.Request, req: Message) -> Message:
        user, path = self._user_path(request, req)
        return {"entry": await self._as(user, f"cannot create directory '{path}'", lambda: _make_dir(path))}

    async def move(self, request: web.Request, req: Message) -> Message:
        user = request_user(request, self.state)
        src = resolve_path(text(req, "source"), user, self.state.default_workdir)
        dst = resolve_path(text(req, "destination"), user, self.state.default_workdir)
        entry = await self._as(user, f"cannot move '{src}' to '{dst}'", lambda: _move(src, dst))
        return {"entry": entry}

    async def list_dir(self, request: web.Request, req: Message) -> Message:
        user, path = self._user_path(request, req)
        depth = uint32(req, "depth") or 1
        return {"entries": await self._as(user, f"cannot list '{path}'", lambda: _list(path, depth))}

    async def remove(self, request: web.Request, req: Message) -> Message:
        user, path = self._user_path(request, req)
        await self._as(user, f"cannot remove '{path}'", lambda: _remove(path))
        return {}

    async def _watch(self, request: web.Request, req: Message, emit: Callable[[Message], None]) -> Watcher:
        user, path = self._user_path(request, req)

        def check() -> None:
            if not stat.S_ISDIR(os.stat(path).st_mode):
                raise ConnectError("invalid_argument", f"path '{path}' is not a directory")
            if not flag(req, "allowNetworkMounts", "allow_network_mounts") and _is_network_mount(path):
                raise ConnectError("invalid_argument", f"path '{path}' is on a network mount")

        await self._as(user, f"cannot watch '{path}'", check)
        recursive, include_entry = flag(req, "recursive"), flag(req, "includeEntry", "include_entry")
        watcher = Watcher(path, bool(recursive), bool(include_entry), emit)
        try:
            watcher.start()
        except OSError as e:
            raise os_error(e, f"cannot watch '{path}'") from None
        return watcher

    async def watch_dir(self, request: web.Request, req: Message) -> AsyncIterator[Message]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Message] = asyncio.Queue()
        watcher = await self._watch(request, req, lambda ev: queue.put_nowait({"filesystem": ev}))
        keepalive = keepalive_seconds(request)
        timeout = timeout_seconds(request)
        deadline = loop.time() + timeout if timeout else None
        try:
            yield {"start": {}}
            while True:
                wait = keepalive if deadline is None else min(keepalive, deadline - loop.time())
                if wait <= 0:
                    raise ConnectError("deadline_exceeded", "the operation timed out")
                try:
                    yield await asyncio.wait_for(queue.get(), wait)
                except TimeoutError:
                    if deadline is None or loop.time() < deadline:
                        yield {"keepalive": {}}
        finally:
            watcher.close()

    async def create_watcher(self, request: web.Request, req: Message) -> Message:
        buffered = _BufferedWatcher()
        buffered.watcher = await self._watch(request, req, buffered.push)
        watcher_id = f"w{next(self._ids)}"
        self.watchers[watcher_id] = buffered
        return {"watcherId": watcher_id}

    def _watcher(self, req: Message) -> tuple[str, _BufferedWatcher]:
        watcher_id = text(req, "watcherId", "watcher_id")
        buffered = self.watchers.get(watcher_id)
        if buffered is None:
            raise ConnectError("not_found", f"watcher '{watcher_id}' not found")
        return watcher_id, buffered

    async def get_watcher_events(self, request: web.Request, req: Message) -> Message:
        _, buffered = self._watcher(req)
        events, buffered.events = buffered.events, []
        return {"events": events}

    async def remove_watcher(self, request: web.Request, req: Message) -> Message:
        watcher_id, buffered = self._watcher(req)
        del self.watchers[watcher_id]
        if buffered.watcher is not None:
            buffered.watcher.close()
        return {}

    def shutdown(self) -> None:
        for buffered in self.watchers.values():
            if buffered.watcher is not None:
                buffered.watcher.close()
        self.watchers.clear()
