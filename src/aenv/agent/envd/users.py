"""User identity: request user selection, path resolution and per-thread filesystem credentials."""

from __future__ import annotations

import base64
import ctypes
import logging
import os
import platform
import pwd
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from aiohttp import web

from .connect import ConnectError
from .inputs import path_string
from .state import State

log = logging.getLogger(__name__)
T = TypeVar("T")

# Raw syscall numbers: the glibc wrappers for setgroups broadcast to every thread, the raw syscalls
# (like setfsuid/setfsgid) only affect the calling thread, which is what lets one worker thread act as a
# user while the rest of envd stays root.
_SYSCALLS = {
    "x86_64": {"setgroups": 116, "setfsuid": 122, "setfsgid": 123},
    "aarch64": {"setgroups": 159, "setfsuid": 151, "setfsgid": 152},
}


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: str
    shell: str

    @property
    def groups(self) -> list[int]:
        """Supplementary groups as initgroups(3) would set them."""
        try:
            return os.getgrouplist(self.name, self.gid)
        except OSError:
            return [self.gid]


def lookup_user(name: str) -> User:
    """Resolve a user name; unknown names are an authentication failure, as in the reference envd.

    root always exists, even in an image without /etc/passwd (a bare busybox tree)."""
    try:
        pw = pwd.getpwnam(name)
    except (KeyError, ValueError):  # ValueError: a NUL byte or an unencodable name, never a user
        if name == "root":
            return User("root", 0, 0, "/root" if os.path.isdir("/root") else "/", "/bin/sh")
        raise ConnectError("unauthenticated", f"invalid username: '{name[:256]}'") from None
    return User(pw.pw_name, pw.pw_uid, pw.pw_gid, pw.pw_dir or "/", pw.pw_shell or "/bin/sh")


def default_user(state: State) -> User:
    """The configured default user, falling back to root when that account does not exist."""
    try:
        return lookup_user(state.default_user)
    except ConnectError:
        return lookup_user("root")


def request_user(request: web.Request, state: State) -> User:
    """User from `Authorization: Basic base64(user:)`, else the default user."""
    header = request.headers.get("Authorization", "")
    if header[:6].lower() == "basic ":
        try:
            decoded = base64.b64decode(header[6:].strip()).decode()
        except (ValueError, UnicodeDecodeError):
            raise ConnectError("unauthenticated", "invalid authorization header") from None
        name = decoded.split(":", 1)[0]
        if name:
            return lookup_user(name)
    return default_user(state)


def resolve_path(path: str, user: User, workdir: str | None) -> str:
    """Expand `~`, make relative paths relative to the user's home; empty means the default workdir.

    Paths the kernel could never take (NUL bytes, longer than PATH_MAX) are `invalid_argument`."""
    path_string(path)
    if not path:
        return os.path.normpath(workdir or user.home)
    if path == "~" or path.startswith("~/"):
        path = user.home + path[1:]
    elif path.startswith("~"):
        raise ConnectError("invalid_argument", f"path '{path}' uses an unsupported ~user form")
    if not os.path.isabs(path):
        path = os.path.join(user.home, path)
    return path_string(os.path.normpath(path))


class _FsCreds:
    """Switches filesystem uid/gid/groups of the *calling thread only* via raw syscalls."""

    def __init__(self) -> None:
        self._nums = _SYSCALLS.get(platform.machine())
        self._libc: ctypes.CDLL | None = None
        self.enabled = os.geteuid() == 0 and self._nums is not None
        self._root_groups = os.getgroups() if self.enabled else []
        if os.geteuid() == 0 and self._nums is None:
            log.warning("unknown architecture %s: file operations run as root", platform.machine())

    def _call(self, name: str, *args: object) -> int:
        if self._libc is None:
            self._libc = ctypes.CDLL(None, use_errno=True)
        assert self._nums is not None
        return self._libc.syscall(self._nums[name], *args)

    def _setgroups(self, gids: list[int]) -> None:
        arr = (ctypes.c_uint * max(1, len(gids)))(*gids)
        if self._call("setgroups", ctypes.c_size_t(len(gids)), arr) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def run(self, user: User, fn: Callable[[], T]) -> T:
        if not self.enabled or user.uid == 0:
            return fn()
        self._setgroups(user.groups)
        self._call("setfsgid", ctypes.c_uint(user.gid))
        self._call("setfsuid", ctypes.c_uint(user.uid))
        try:
            return fn()
        finally:
            self._call("setfsuid", ctypes.c_uint(0))
            self._call("setfsgid", ctypes.c_uint(0))
            self._setgroups(self._root_groups)


_creds = _FsCreds()


def run_as(user: User, fn: Callable[[], T]) -> T:
    """Run blocking filesystem code in the current (worker) thread with the user's file permissions.

    Files created inside are owned by the user without an explicit chown."""
    return _creds.run(user, fn)
