"""The volume content API's file operations on one volume's data directory.

Paths are the SDK's: relative to the volume's root, with or without a leading `/`. Sandboxes
write into the same directory (through the volume server), so a path may meet a symlink a
guest made: every path is resolved with symlinks followed and refused unless it stays inside
the volume, and the last component is never followed where that would act on its target.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..orchestrator.errors import Conflict, InvalidRequest, NotFound

CHUNK = 1 << 20
MAX_DEPTH = 16


class VolumeContent:
    """File operations confined to `root` (a volume's data directory)."""

    def __init__(self, root: Path):
        self.root = root.resolve()

    # -- paths -----------------------------------------------------------------------------

    def _relative(self, path: str) -> str:
        if "\0" in path:
            raise InvalidRequest("path must not contain NUL")
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise InvalidRequest(f"path {path!r} must not contain '..'")
        return "/".join(parts)

    def _inside(self, real: Path) -> bool:
        return real == self.root or self.root in real.parents

    def resolve(self, path: str) -> Path:
        """`path` in the volume; its parent resolved through symlinks, which must stay inside."""
        relative = self._relative(path)
        if not relative:
            return self.root
        target = self.root / relative
        parent = target.parent.resolve()
        if not self._inside(parent):
            raise InvalidRequest(f"path {path!r} leads outside the volume")
        return parent / target.name

    def _public(self, real: Path) -> str:
        return "/" + str(real.relative_to(self.root)) if real != self.root else "/"

    def _missing(self, path: str) -> NotFound:
        return NotFound(f"path {path} not found in the volume")

    # -- reads -----------------------------------------------------------------------------

    def entry(self, real: Path) -> dict[str, Any]:
        """E2B's `VolumeEntryStat` of a path (not following a final symlink)."""
        info = real.lstat()
        kind = (
            "directory"
            if stat.S_ISDIR(info.st_mode)
            else "file"
            if stat.S_ISREG(info.st_mode)
            else "symlink"
            if stat.S_ISLNK(info.st_mode)
            else "unknown"
        )
        body: dict[str, Any] = {
            "name": real.name if real != self.root else "/",
            "type": kind,
            "path": self._public(real),
            "size": info.st_size,
            "mode": stat.S_IMODE(info.st_mode),
            "uid": info.st_uid,
            "gid": info.st_gid,
            "atime": _time(info.st_atime),
            "mtime": _time(info.st_mtime),
            "ctime": _time(info.st_ctime),
        }
        if kind == "symlink":
            body["target"] = os.readlink(real)
        return body

    def stat(self, path: str) -> dict[str, Any]:
        real = self.resolve(path)
        try:
            return self.entry(real)
        except FileNotFoundError:
            raise self._missing(path) from None

    def list(self, path: str, depth: int) -> list[dict[str, Any]]:
        """The entries below a directory, `depth` levels deep (1: its own entries)."""
        if not 1 <= depth <= MAX_DEPTH:
            raise InvalidRequest(f"depth must be between 1 and {MAX_DEPTH}")
        real = self.resolve(path)
        if not real.is_dir() or real.is_symlink():
            if not real.exists() and not real.is_symlink():
                raise self._missing(path)
            raise InvalidRequest(f"path {path} is not a directory")
        return list(self._walk(real, depth))

    def _walk(self, directory: Path, depth: int) -> Iterator[dict[str, Any]]:
        for child in sorted(directory.iterdir()):
            try:
                entry = self.entry(child)
            except FileNotFoundError:
                continue  # removed meanwhile
            yield entry
            if depth > 1 and entry["type"] == "directory":
                yield from self._walk(child, depth - 1)

    def open_file(self, path: str) -> tuple[int, int]:
        """A descriptor on a regular file for reading, and its size."""
        real = self.resolve(path)
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise self._missing(path) from None
        except OSError as exc:
            raise InvalidRequest(f"path {path} cannot be read: {exc.strerror}") from exc
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise InvalidRequest(f"path {path} is not a regular file")
        return fd, info.st_size

    # -- writes ----------------------------------------------------------------------------

    def _parent(self, path: str, real: Path, parents: bool) -> None:
        if real == self.root:
            raise InvalidRequest("the volume's root cannot be replaced")
        if real.parent.is_dir():
            return
        if not parents:
            raise NotFound(f"the parent directory of {path} does not exist (force creates it)")
        try:
            real.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise Conflict(f"a parent of {path} is not a directory") from None
        if not self._inside(real.parent.resolve()):
            raise InvalidRequest(f"path {path!r} leads outside the volume")

    def make_dir(self, path: str, *, parents: bool, owner: Owner) -> dict[str, Any]:
        real = self.resolve(path)
        self._parent(path, real, parents)
        try:
            real.mkdir(mode=0o755)
        except FileExistsError:
            raise Conflict(f"{path} already exists") from None
        owner.apply(real)
        return self.entry(real)

    async def write_file(
        self, path: str, chunks: AsyncIterator[bytes], *, parents: bool, owner: Owner
    ) -> dict[str, Any]:
        """Write the file from `chunks` through a temporary file, replacing it in one rename."""
        real = self.resolve(path)
        self._parent(path, real, parents)
        if real.is_dir() and not real.is_symlink():
            raise Conflict(f"{path} is a directory")
        temporary = real.with_name(f".{real.name}.aenv-upload-{os.getpid()}-{id(chunks)}")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                async for chunk in chunks:
                    f.write(chunk)
            owner.apply(temporary)
            os.replace(temporary, real)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        return self.entry(real)

    def update(self, path: str, owner: Owner) -> dict[str, Any]:
        real = self.resolve(path)
        if not real.exists() and not real.is_symlink():
            raise self._missing(path)
        owner.apply(real)
        return self.entry(real)

    def remove(self, path: str) -> None:
        real = self.resolve(path)
        if real == self.root:
            raise InvalidRequest("the volume's root cannot be removed")
        if real.is_dir() and not real.is_symlink():
            shutil.rmtree(real)
        else:
            try:
                real.unlink()
            except FileNotFoundError:
                raise self._missing(path) from None


class Owner:
    """Owner and mode to set on a created or updated entry (unset fields are left alone)."""

    def __init__(self, uid: int | None = None, gid: int | None = None, mode: int | None = None):
        for name, value, high in (("uid", uid, 1 << 32), ("gid", gid, 1 << 32), ("mode", mode, 0o7777 + 1)):
            if value is not None and not 0 <= value < high:
                raise InvalidRequest(f"{name} {value} is out of range")
        self.uid, self.gid, self.mode = uid, gid, mode

    def apply(self, real: Path) -> None:
        if self.uid is not None or self.gid is not None:
            os.chown(real, -1 if self.uid is None else self.uid, -1 if self.gid is None else self.gid,
                     follow_symlinks=False)  # fmt: skip
        if self.mode is not None and not real.is_symlink():
            os.chmod(real, self.mode)


def _time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")
