"""The volume content API's file operations on one volume's data directory.

Paths are the SDK's: relative to the volume's root, with or without a leading `/`. Sandboxes
write into the same directory (through the volume server) and may plant symlinks there, while
this runs as root on the host: so every directory is opened with `openat2(RESOLVE_BENEATH)`
from the volume's root, which the kernel refuses to leave by any symlink or `..`, and the final
component is only ever acted on relative to that directory's descriptor, never followed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..orchestrator.errors import Conflict, InsufficientStorage, InvalidRequest, NotFound, OperationFailed
from .store import IdRange
from .tree import remove_tree

CHUNK = 1 << 20
MAX_DEPTH = 16
SYS_OPENAT2 = 437  # x86-64 and arm64 alike (the unified syscall table)
RESOLVE_BENEATH = 0x08
_libc = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def open_beneath(root: int, relative: str, flags: int) -> int:
    """openat2(2) of `relative` below the directory `root`, never resolving to outside it."""
    how = _OpenHow(flags | os.O_CLOEXEC, 0, RESOLVE_BENEATH)
    fd = _libc.syscall(
        ctypes.c_long(SYS_OPENAT2), ctypes.c_long(root), ctypes.c_char_p(relative.encode() or b"."),
        ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)),
    )  # fmt: skip
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), relative)
    return fd


FULL = (errno.ENOSPC, errno.EDQUOT)


class VolumeContent:
    """File operations confined to `root` (a volume's data directory); owners are shown and set
    as guests see them (`ids`: the host ids they are)."""

    def __init__(self, root: Path, ids: IdRange):
        self.root = root
        self.ids = ids

    # -- paths -----------------------------------------------------------------------------

    @staticmethod
    def _parts(path: str) -> list[str]:
        if "\0" in path:
            raise InvalidRequest("path must not contain NUL")
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise InvalidRequest(f"path {path!r} must not contain '..'")
        return parts

    @contextlib.contextmanager
    def _directory(self, parts: list[str], path: str, *, create: bool = False) -> Iterator[int]:
        """A descriptor on the directory `parts` below the root (made first with `create`)."""
        root = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if create:
                for depth in range(1, len(parts) + 1):
                    with (
                        self._directory(parts[: depth - 1], path) as parent,
                        contextlib.suppress(FileExistsError),
                    ):
                        os.mkdir(parts[depth - 1], 0o755, dir_fd=parent)
                        Owner(0, 0).apply(parent, parts[depth - 1], self.ids)
            try:
                fd = open_beneath(root, "/".join(parts), os.O_PATH | os.O_DIRECTORY)
            except OSError as exc:
                raise _refusal(exc, path) from None
        finally:
            os.close(root)
        try:
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _parent(self, path: str, *, create: bool = False) -> Iterator[tuple[int, str, str]]:
        """The parent directory's descriptor, the final name and the public path of `path`."""
        parts = self._parts(path)
        if not parts:
            raise InvalidRequest("this cannot be done to the volume's root")
        with self._directory(parts[:-1], path, create=create) as fd:
            yield fd, parts[-1], "/" + "/".join(parts)

    # -- reads -----------------------------------------------------------------------------

    def _entry(self, directory: int, name: str, public: str) -> dict[str, Any]:
        """E2B's `VolumeEntryStat` of `name` in `directory` (a final symlink is not followed)."""
        info = os.stat(name, dir_fd=directory, follow_symlinks=False)
        mode = info.st_mode
        kind = "directory" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "unknown"
        kind = "symlink" if stat.S_ISLNK(mode) else kind
        body: dict[str, Any] = {
            "name": public.rsplit("/", 1)[-1] or "/",
            "type": kind,
            "path": public,
            "size": info.st_size,
            "mode": stat.S_IMODE(mode),
            "uid": self.ids.guest(info.st_uid),
            "gid": self.ids.guest(info.st_gid),
            "atime": _time(info.st_atime),
            "mtime": _time(info.st_mtime),
            "ctime": _time(info.st_ctime),
        }
        if kind == "symlink":
            body["target"] = os.readlink(name, dir_fd=directory)
        return body

    def stat(self, path: str) -> dict[str, Any]:
        if not self._parts(path):
            with self._directory([], path) as fd:
                return self._entry(fd, ".", "/")
        with self._parent(path) as (fd, name, public):
            try:
                return self._entry(fd, name, public)
            except FileNotFoundError:
                raise _missing(path) from None

    def list(self, path: str, depth: int) -> list[dict[str, Any]]:
        """The entries below a directory, `depth` levels deep (1: its own entries)."""
        if not 1 <= depth <= MAX_DEPTH:
            raise InvalidRequest(f"depth must be between 1 and {MAX_DEPTH}")
        parts = self._parts(path)
        with self._directory(parts, path) as fd:
            return list(self._walk(fd, "/" + "/".join(parts), depth))

    def _walk(self, directory: int, public: str, depth: int) -> Iterator[dict[str, Any]]:
        listing = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=directory)
        try:
            names = sorted(os.listdir(listing))
        finally:
            os.close(listing)
        for name in names:
            child = f"{public.rstrip('/')}/{name}"
            try:
                entry = self._entry(directory, name, child)
            except FileNotFoundError:
                continue  # removed meanwhile
            yield entry
            if depth > 1 and entry["type"] == "directory":
                try:
                    fd = open_beneath(directory, name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
                except OSError:
                    continue  # replaced meanwhile
                try:
                    yield from self._walk(fd, child, depth - 1)
                finally:
                    os.close(fd)

    def open_file(self, path: str) -> tuple[int, int]:
        """A descriptor on a regular file for reading, and its size. Anything else is never
        opened (only looked at through an O_PATH descriptor): opening a device node or a FIFO a
        volume of before the volume server's confinement may hold could act on the host."""
        with self._parent(path) as (directory, name, _):
            try:
                handle = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
            except OSError as exc:
                raise _refusal(exc, path) from None
        try:
            if not stat.S_ISREG(os.fstat(handle).st_mode):
                raise InvalidRequest(f"path {path} is not a regular file")
            fd = os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_CLOEXEC)  # that same inode
        finally:
            os.close(handle)
        return fd, os.fstat(fd).st_size

    # -- writes ----------------------------------------------------------------------------

    def make_dir(self, path: str, *, parents: bool, owner: Owner) -> dict[str, Any]:
        with _full(path), self._parent(path, create=parents) as (fd, name, public):
            try:
                os.mkdir(name, 0o755, dir_fd=fd)
            except FileExistsError:
                raise Conflict(f"{path} already exists") from None
            owner.created().apply(fd, name, self.ids)
            return self._entry(fd, name, public)

    async def write_file(
        self, path: str, chunks: AsyncIterator[bytes], *, parents: bool, owner: Owner
    ) -> dict[str, Any]:
        """Write the file from `chunks` through a temporary file, replacing it in one rename (a
        write past the volume's size leaves the file as it was)."""
        with _full(path), self._parent(path, create=parents) as (directory, name, public):
            temporary = f".{name}.aenv-upload-{os.getpid()}-{id(chunks)}"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(temporary, flags, 0o644, dir_fd=directory)
            try:
                with os.fdopen(fd, "wb") as f:
                    async for chunk in chunks:
                        f.write(chunk)
                owner.created().apply(directory, temporary, self.ids)
                os.rename(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)
            except IsADirectoryError:
                os.unlink(temporary, dir_fd=directory)
                raise Conflict(f"{path} is a directory") from None
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temporary, dir_fd=directory)
                raise
            return self._entry(directory, name, public)

    def update(self, path: str, owner: Owner) -> dict[str, Any]:
        with self._parent(path) as (fd, name, public):
            try:
                owner.apply(fd, name, self.ids)
                return self._entry(fd, name, public)
            except FileNotFoundError:
                raise _missing(path) from None

    def remove(self, path: str) -> None:
        """Remove a file, or a directory with everything in it at any depth (`aenv.volumes.tree`)."""
        with self._parent(path) as (fd, name, _):
            try:
                os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                raise _missing(path) from None
            try:
                remove_tree(fd, name)
            except OSError as exc:
                raise OperationFailed(
                    f"removing {path} failed ({exc.strerror}): what was not yet removed is still there"
                ) from None


class Owner:
    """Owner and mode to set on a created or updated entry (unset fields are left alone)."""

    def __init__(self, uid: int | None = None, gid: int | None = None, mode: int | None = None):
        self.uid, self.gid, self.mode = uid, gid, mode

    def created(self) -> Owner:
        """For an entry the content API makes: owned by the guests' root unless said otherwise."""
        return Owner(0 if self.uid is None else self.uid, 0 if self.gid is None else self.gid, self.mode)

    def apply(self, directory: int, name: str, ids: IdRange) -> None:
        if self.uid is not None or self.gid is not None:
            uid, gid = (-1 if v is None else ids.host(v) for v in (self.uid, self.gid))
            os.chown(name, uid, gid, dir_fd=directory, follow_symlinks=False)
        if self.mode is not None:
            info = os.stat(name, dir_fd=directory, follow_symlinks=False)
            if not stat.S_ISLNK(info.st_mode):  # a symlink's mode means nothing (and chmod would follow it)
                fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
                try:
                    os.chmod(f"/proc/self/fd/{fd}", self.mode)
                finally:
                    os.close(fd)


@contextlib.contextmanager
def _full(path: str) -> Iterator[None]:
    """A write that found the volume full: E2B's answer for no space (507)."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in FULL:
            raise
        raise InsufficientStorage(f"the volume is full: {path} was not written") from None


def _missing(path: str) -> NotFound:
    return NotFound(f"path {path} not found in the volume")


def _refusal(exc: OSError, path: str) -> Exception:
    """An error resolving `path` as the client's answer (a missing path, one leading outside)."""
    if exc.errno == errno.ENOENT:
        return _missing(path)
    if exc.errno == errno.EXDEV:  # RESOLVE_BENEATH: a symlink or `..` would leave the volume
        return InvalidRequest(f"path {path!r} leads outside the volume")
    if exc.errno in (errno.ENOTDIR, errno.ELOOP):
        return InvalidRequest(f"path {path} is not a directory here (or is a symlink)")
    return InvalidRequest(f"path {path} cannot be used: {exc.strerror}")


def _time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")
