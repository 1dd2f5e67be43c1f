"""Creating users, their groups and homes in the guest's image, without the image's tools.

A template built from an image gets E2B's ``user`` (and any ``USER`` a step names) whatever the
image has: Debian's ``useradd``, busybox's ``adduser`` applet (Debian's busybox-static has none),
or no shell at all (distroless). envd runs on its own runtime, so it writes the account
databases itself, as ``useradd -m`` does on Debian (the defaults of Debian 12's
``/etc/login.defs`` and ``/etc/default/useradd``):

- a user-private group with the user's uid as gid when that gid is free, else the next free one;
- the next uid after the highest in 1000-59999 (``UID_MIN``/``UID_MAX``), as ``useradd`` picks;
- ``/etc/shadow`` and ``/etc/gshadow`` entries (locked password) only where the image has them;
- a home of mode 0755 (``UMASK`` 022) with ``/etc/skel`` copied in, owned by the user.

Every change holds ``/etc/.pwd.lock`` (what ``lckpwdf(3)`` locks, so the image's own tools
never interleave) and appends whole lines, so an interrupted write leaves the files readable.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass

ROOT = "/"  # the image's root (a tree elsewhere in unit tests)
NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")  # Debian's NAME_REGEX, and its 32-character limit
FIRST_ID, LAST_ID = 1000, 59999
HOME_MODE = 0o755
SHELL = "/bin/sh"  # Debian's useradd default
SUDOERS = "ALL=(ALL:ALL) NOPASSWD: ALL"  # what the `base` template gives `user`
SUDO = ("/usr/bin/sudo", "/bin/sudo")


class AccountError(Exception):
    """A user or group cannot be created or found as asked."""


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    home: str


def _etc(name: str) -> str:
    return os.path.join(ROOT, "etc", name)


def _table(name: str) -> list[list[str]]:
    try:
        with open(_etc(name), encoding="utf-8", errors="surrogateescape") as f:
            return [line.split(":") for line in f.read().splitlines() if line and not line.startswith("#")]
    except FileNotFoundError:
        return []


def _append(name: str, line: str, mode: int) -> None:
    """Add one entry; a file that does not end its last line gets the newline first."""
    path = _etc(name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, mode)
    try:
        size = os.fstat(fd).st_size
        prefix = "\n" if size and os.pread(fd, 1, size - 1) != b"\n" else ""
        os.write(fd, (prefix + line + "\n").encode(errors="surrogateescape"))
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    os.makedirs(_etc(""), mode=0o755, exist_ok=True)
    fd = os.open(_etc(".pwd.lock"), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _next_id(used: set[int], preferred: int | None = None) -> int:
    if preferred is not None and preferred not in used:
        return preferred
    in_range = [i for i in used if FIRST_ID <= i <= LAST_ID]
    candidate = max(in_range) + 1 if in_range else FIRST_ID
    while candidate in used:
        candidate += 1
    if candidate > LAST_ID:
        raise AccountError(f"no free id left in {FIRST_ID}-{LAST_ID}")
    return candidate


def find_user(name: str) -> Account | None:
    for entry in _table("passwd"):
        if entry[0] == name and len(entry) >= 6 and entry[2].isdigit() and entry[3].isdigit():
            return Account(name, int(entry[2]), int(entry[3]), entry[5] or "/")
    return None


def find_group(name: str) -> int | None:
    for entry in _table("group"):
        if entry[0] == name and len(entry) >= 3 and entry[2].isdigit():
            return int(entry[2])
    return None


def ensure_user(name: str) -> Account:
    """The account ``name``, created (with its group and home) if the image lacks it."""
    with _locked():
        existing = find_user(name)
        if existing is not None:  # whatever its name's form, as the image made it
            return existing
        if not NAME.match(name):
            raise AccountError(f"invalid user name {name!r}: lowercase letters, digits, '_' and '-' expected")
        passwd = _table("passwd")
        if not passwd:  # an image without users: root first, as every tool expects
            _append("passwd", "root:x:0:0:root:/root:/bin/sh", 0o644)
            passwd = _table("passwd")
        uid = _next_id({int(e[2]) for e in passwd if len(e) > 2 and e[2].isdigit()})
        gid = find_group(name)
        if gid is None:
            groups = _table("group")
            gid = _next_id({int(e[2]) for e in groups if len(e) > 2 and e[2].isdigit()}, uid)
            _append("group", f"{name}:x:{gid}:", 0o644)
            if os.path.exists(_etc("gshadow")):
                _append("gshadow", f"{name}:!::", 0o640)
        home = f"/home/{name}"
        _append("passwd", f"{name}:x:{uid}:{gid}::{home}:{SHELL}", 0o644)
        if os.path.exists(_etc("shadow")):
            _append("shadow", f"{name}:!:{int(time.time() // 86400)}:0:99999:7:::", 0o640)
    account = Account(name, uid, gid, home)
    _make_home(account)
    return account


def _make_home(account: Account) -> None:
    """The new user's home, with the image's /etc/skel (if any) copied in, all the user's."""
    home = os.path.join(ROOT, account.home.lstrip("/"))
    if os.path.lexists(home):
        return
    os.makedirs(os.path.dirname(home), mode=0o755, exist_ok=True)
    skel = _etc("skel")
    if os.path.isdir(skel):
        shutil.copytree(skel, home, symlinks=True)
    else:
        os.mkdir(home)
    os.chmod(home, HOME_MODE)
    for root, dirs, files in os.walk(home):
        for entry in [root, *(os.path.join(root, n) for n in dirs + files)]:
            os.lchown(entry, account.uid, account.gid)


def grant_sudo(name: str) -> bool:
    """Passwordless sudo for ``name``, as the ``base`` template gives ``user``, where the image
    has sudo and reads ``/etc/sudoers.d``; an entry already there is left alone."""
    drop_in = _etc("sudoers.d")
    if not os.path.isdir(drop_in) or not any(os.path.exists(os.path.join(ROOT, p.lstrip("/"))) for p in SUDO):
        return False
    path = os.path.join(drop_in, name)
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o440)
        try:
            os.write(fd, f"{name} {SUDOERS}\n".encode())
        finally:
            os.close(fd)
    return True


def owner(spec: str) -> tuple[int, int]:
    """COPY's ``user[:group]`` (names or numbers) as ids; a numeric user alone gets gid 0."""
    user, _, group = spec.partition(":")
    if user.isdigit():
        uid, gid = int(user), 0
    elif user == "root" and find_user(user) is None:  # root, even in an image without /etc/passwd
        uid, gid = 0, 0
    else:
        account = find_user(user)
        if account is None:
            raise AccountError(f"COPY owner {spec!r}: the image has no user {user!r}")
        uid, gid = account.uid, account.gid
    if group.isdigit():
        gid = int(group)
    elif group:
        found = find_group(group)
        if found is None:
            raise AccountError(f"COPY owner {spec!r}: the image has no group {group!r}")
        gid = found
    return uid, gid
