"""Directory watching with inotify through ctypes (no third-party dependency in the guest)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import struct
from collections.abc import Callable
from typing import Any

from .entry import entry_info

log = logging.getLogger(__name__)

IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x1000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
# The mask fsnotify (used by the reference envd) registers.
WATCH_MASK = (
    IN_MODIFY
    | IN_ATTRIB
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_ONLYDIR
)
_HEADER = struct.Struct("iIII")
# inotify bit -> FilesystemEvent type; one event per bit, like fsnotify's Op bits.
_TYPES = (
    (IN_CREATE | IN_MOVED_TO, "EVENT_TYPE_CREATE"),
    (IN_MODIFY, "EVENT_TYPE_WRITE"),
    (IN_ATTRIB, "EVENT_TYPE_CHMOD"),
    (IN_DELETE, "EVENT_TYPE_REMOVE"),
    (IN_MOVED_FROM, "EVENT_TYPE_RENAME"),
)
_WITH_ENTRY = {"EVENT_TYPE_CREATE", "EVENT_TYPE_WRITE", "EVENT_TYPE_CHMOD"}

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _check(ret: int) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


class Watcher:
    """Watches a directory (optionally recursively) and reports FilesystemEvent dicts to `emit`."""

    def __init__(
        self, root: str, recursive: bool, include_entry: bool, emit: Callable[[dict[str, Any]], None]
    ) -> None:
        self.root = root
        self.recursive = recursive
        self.include_entry = include_entry
        self.emit = emit
        self.fd = -1
        self.dirs: dict[int, str] = {}

    def start(self) -> None:
        """Create the inotify instance and watches; raises OSError (e.g. ENOENT, ENOTDIR)."""
        self.fd = _check(_lib().inotify_init1(IN_NONBLOCK | IN_CLOEXEC))
        try:
            self._add("")
        except OSError:
            os.close(self.fd)
            self.fd = -1
            raise
        asyncio.get_running_loop().add_reader(self.fd, self._on_readable)

    def _add(self, rel: str) -> None:
        path = os.path.join(self.root, rel) if rel else self.root
        wd = _check(_lib().inotify_add_watch(self.fd, os.fsencode(path), WATCH_MASK))
        self.dirs[wd] = rel
        if not self.recursive:
            return
        try:
            with os.scandir(path) as it:
                children = [e.name for e in it if e.is_dir(follow_symlinks=False)]
        except OSError:
            return
        for name in children:
            try:
                self._add(os.path.join(rel, name) if rel else name)
            except OSError:
                continue

    def _on_readable(self) -> None:
        try:
            buf = os.read(self.fd, 64 * 1024)
        except BlockingIOError:
            return
        except OSError as e:
            log.warning("inotify read failed: %s", e)
            self.close()
            return
        offset = 0
        while offset + _HEADER.size <= len(buf):
            wd, mask, _cookie, length = _HEADER.unpack_from(buf, offset)
            raw = buf[offset + _HEADER.size : offset + _HEADER.size + length]
            offset += _HEADER.size + length
            self._handle(wd, mask, os.fsdecode(raw.rstrip(b"\0")))

    def _handle(self, wd: int, mask: int, name: str) -> None:
        if mask & IN_Q_OVERFLOW:
            log.warning("inotify queue overflow watching %s", self.root)
            return
        if mask & IN_IGNORED:
            self.dirs.pop(wd, None)
            return
        base = self.dirs.get(wd)
        if base is None or not name:  # events about a watched directory itself come from its parent
            return
        rel = os.path.join(base, name) if base else name
        if self.recursive and mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
            with contextlib.suppress(OSError):
                self._add(rel)
        for bits, kind in _TYPES:
            if mask & bits:
                event: dict[str, Any] = {"name": rel, "type": kind}
                if self.include_entry and kind in _WITH_ENTRY:
                    with contextlib.suppress(OSError):
                        event["entry"] = entry_info(os.path.join(self.root, rel))
                self.emit(event)

    def close(self) -> None:
        if self.fd >= 0:
            asyncio.get_running_loop().remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1
            self.dirs.clear()
