"""A template's ``COPY``: which archive members go where (Docker's rules), and writing them.

The node checks an upload against its hash and finds the members the ``COPY`` source named
(``roots``); envd in the build VM unpacks the archive as it arrives (``unpack``), so no ``tar``
is needed in the image and the node never holds the archive. Both sides refuse what a build
context cannot hold (``check``): names leaving the destination, devices, FIFOs, hard links to
files outside the copied ones. Owner and mode are the step's, applied to every member.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
import tarfile
from dataclasses import dataclass
from typing import IO

CHUNK = 1 << 20
MAX_MEMBERS = 200_000


class CopyError(Exception):
    """The archive or the plan cannot be copied as given."""


@dataclass(frozen=True)
class CopyPlan:
    """What the node tells envd about a COPY: the source's roots, where they go, how they are owned."""

    roots: list[tuple[str, bool]]  # (member name, is a directory)
    dest: str  # absolute; ending in "/" when the step's destination did
    uid: int = 0
    gid: int = 0
    mode: int | None = None


def check(member: tarfile.TarInfo) -> None:
    """Refuse a member a build context cannot hold."""
    name = member.name
    if not name or name.startswith("/") or ".." in name.split("/") or "\0" in name:
        raise CopyError(f"the uploaded archive holds an unsafe path {name!r}")
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        raise CopyError(f"the uploaded archive holds {name!r}, which is not a file, directory or link")
    if member.islnk() and (member.linkname.startswith("/") or ".." in member.linkname.split("/")):
        raise CopyError(f"the uploaded archive holds a hard link escaping it: {name!r}")


def roots(entries: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    """The members the COPY source named: those not inside another member directory.

    The SDK names members relative to the build context, so copying the context itself (``.``)
    holds ``.`` and then its entries as ``name``, not ``./name``.
    """
    dot = [entry for entry in entries if entry[0] == "."]
    if dot:
        return dot[:1]
    dirs = {name for name, is_dir in entries if is_dir}

    def inside(name: str) -> bool:
        parent = posixpath.dirname(name)
        while parent:
            if parent in dirs:
                return True
            parent = posixpath.dirname(parent)
        return False

    return [entry for entry in entries if not inside(entry[0])]


def placement(plan: CopyPlan, dest_is_dir: bool) -> dict[str, str]:
    """Where each root goes: a directory's contents into ``dest``; a file to ``dest`` itself
    unless ``dest`` is a directory (it ends with ``/``, exists, or several sources are copied)."""
    into_dir = dest_is_dir or plan.dest.endswith("/") or len(plan.roots) > 1
    target = posixpath.normpath(plan.dest)
    mapping = {}
    for name, is_dir in plan.roots:
        if is_dir or not into_dir:
            mapping[name] = target
        else:
            mapping[name] = posixpath.join(target, posixpath.basename(name))
    return mapping


def place(name: str, mapping: dict[str, str]) -> str | None:
    """Where member ``name`` goes (None: it is not under any root)."""
    for root, base in mapping.items():
        if name == root:
            return base
        prefix = "" if root == "." else root + "/"
        if name.startswith(prefix):
            return posixpath.join(base, name[len(prefix) :])
    return None


def unpack(source: IO[bytes], plan: CopyPlan) -> int:
    """Write the archive read from ``source`` (plain or gzip tar, read once, in order) as the plan
    says; returns the number of members written. Runs as root in the guest."""
    if not plan.dest.startswith("/"):
        raise CopyError(f"COPY destination {plan.dest!r} is not absolute")
    mapping = placement(plan, os.path.isdir(plan.dest))
    root_dirs = {name for name, is_dir in plan.roots if is_dir}
    for name in root_dirs:
        os.makedirs(mapping[name], mode=0o755, exist_ok=True)
    written = 0
    try:
        with tarfile.open(fileobj=source, mode="r|*", bufsize=CHUNK) as archive:
            for member in archive:
                written += 1
                if written > MAX_MEMBERS:
                    raise CopyError(f"the uploaded archive has more than {MAX_MEMBERS} members")
                check(member)
                target = place(member.name, mapping)
                if target is None or member.name in root_dirs:
                    continue
                _write(archive, member, target, mapping, plan)
    except (tarfile.TarError, EOFError) as exc:
        raise CopyError(f"the uploaded files are not a valid tar archive: {exc}") from None
    return written


def _write(
    archive: tarfile.TarFile, member: tarfile.TarInfo, target: str, mapping: dict[str, str], plan: CopyPlan
) -> None:
    os.makedirs(posixpath.dirname(target), mode=0o755, exist_ok=True)
    mode = stat.S_IMODE(plan.mode if plan.mode is not None else member.mode)
    if member.isdir():
        if not os.path.isdir(target):
            _clear(target)
            os.mkdir(target, 0o700)
        os.chown(target, plan.uid, plan.gid)
        os.chmod(target, mode)
        return
    _clear(target)
    if member.issym():
        os.symlink(member.linkname, target)
        os.chown(target, plan.uid, plan.gid, follow_symlinks=False)
    elif member.islnk():
        linked = place(member.linkname, mapping)
        if linked is None:
            raise CopyError(f"hard link {member.name!r} points outside the copied files")
        os.link(linked, target, follow_symlinks=False)
    else:
        _write_file(archive, member, target, plan.uid, plan.gid, mode)


def _clear(target: str) -> None:
    """Make room for a new entry: what is there is replaced, as tar does, unless a directory."""
    try:
        if stat.S_ISDIR(os.lstat(target).st_mode):
            raise CopyError(f"cannot copy over the directory {target}")
        os.unlink(target)
    except FileNotFoundError:
        pass


def _write_file(
    archive: tarfile.TarFile, member: tarfile.TarInfo, target: str, uid: int, gid: int, mode: int
) -> None:
    data = archive.extractfile(member)
    assert data is not None  # a regular file's
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        while chunk := data.read(CHUNK):
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]
        os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)  # after the chown, which clears setuid bits
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CopyError(f"no space left for {target}") from None
        raise
    finally:
        os.close(fd)
    os.utime(target, (member.mtime, member.mtime), follow_symlinks=False)
