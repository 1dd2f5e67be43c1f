"""Apply image layers to a scratch directory with Docker/OCI semantics, safely against hostile tars.

Layers come from anyone who can push an image, so every path in a layer is treated as hostile.
``tarfile``'s extraction filters check one archive at a time and cannot see a symlink planted by
an earlier layer, so nothing here uses ``extract``; instead every entry's parent directory is
resolved component by component from an open descriptor of the root, with ``O_NOFOLLOW`` at each
step and symlinks interpreted as the image's own (chroot) view: an absolute target restarts at
the root, ``..`` stops at the root. The entry itself is then created relative to that descriptor,
never following a symlink in its last component. No host path outside the root is ever opened.

Decisions per kind of hostile or odd entry:

- ``..`` in an entry or hardlink name: the layer is refused (no legitimate tool writes one).
- absolute names (``/etc/passwd``): taken relative to the root, as Docker does.
- symlinks, absolute or escaping: kept verbatim (the image needs them, e.g. ``/lib -> usr/lib``);
  later entries and layers that write through them stay inside the root, as under chroot.
- hardlinks: the target is resolved inside the root like any path; a missing target or a
  directory refuses the layer. An existing file at the link's name is replaced, never written.
- character and block devices: skipped (the guest has devtmpfs; a device node in a host
  directory would hand host devices to whoever reaches it). FIFOs are created.
- setuid/setgid bits: kept, because images need them (``sudo``, ``su``); ``unpack`` only writes
  below a directory no other host user can enter, so no host user can run them.
- owners: numeric uid/gid applied when running as root (names in the tar are ignored, as in
  Docker); otherwise files belong to the unpacking user.
- xattrs: only ``user.*`` and ``security.capability`` (file capabilities such as ping's) are
  applied; others (``trusted.*``, ``security.selinux``) are dropped.
- duplicate entries: the last one wins (an existing non-directory is replaced, a directory
  only has its metadata updated), which is what Docker does.
- sizes: every file's declared size counts against a per-image budget before any byte is
  written; a truncated file, a truncated stream or a layer whose content does not hash to its
  ``diff_id`` refuses the layer.
- whiteouts: ``.wh.NAME`` removes NAME from lower layers; ``.wh..wh..opq`` empties its directory
  of lower-layer content. They are applied in a first pass over the layer, so they never remove
  what the same layer adds, whatever the entry order.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from aenv.template.image import Image, LayerRefused

log = logging.getLogger(__name__)

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
MAX_SYMLINKS = 40  # as the kernel's path walk
DEFAULT_MAX_BYTES = 64 << 30
XATTR_PREFIXES = ("user.",)
XATTR_NAMES = ("security.capability",)
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_CHUNK = 1 << 20


def unpack(image: Image, dest: Path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
    """Create ``dest`` and apply all of ``image``'s layers to it, bottom layer first.

    ``dest`` must not exist and its parent must be private (no access for group or others):
    the tree holds the image's setuid files and owners. ``max_bytes`` caps the total size of
    regular files across layers. Raises ``LayerRefused`` for a malformed or hostile layer;
    ``dest`` is then left half-written and must be discarded.
    """
    parent_mode = dest.parent.stat().st_mode
    if parent_mode & 0o077:
        raise ValueError(
            f"{dest.parent} must not be accessible to other users (mode {parent_mode & 0o777:o})"
        )
    dest.mkdir(mode=0o755)
    budget = SizeBudget(max_bytes)
    for layer in image.layers:
        apply_layer(dest, layer.path, diff_id=layer.diff_id, budget=budget)


def apply_layer(
    root: Path, blob: Path, *, diff_id: str | None = None, budget: SizeBudget | None = None
) -> None:
    """Apply one layer tarball (plain, gzip or zstd) to the tree at ``root``."""
    tree = _Tree(os.open(root, _DIR), budget or SizeBudget(DEFAULT_MAX_BYTES))
    try:
        with _tar_stream(blob) as stream, tarfile.open(fileobj=_LayerReader(stream), mode="r|") as tar:
            tree.apply_whiteouts(tar)
        with _tar_stream(blob) as stream:
            reader = _LayerReader(stream)
            with tarfile.open(fileobj=reader, mode="r|") as tar:
                tree.extract(tar)
            reader.drain()
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise LayerRefused(f"layer {blob.name} is not a valid tar stream: {exc}") from None
    except OSError as exc:
        raise LayerRefused(f"cannot apply layer {blob.name}: {exc}") from None
    finally:
        os.close(tree.root_fd)
    if diff_id is not None and reader.digest != diff_id:
        raise LayerRefused(
            f"layer {blob.name} unpacks to {reader.digest}, but the image config says {diff_id}"
        )


def compression(blob: Path) -> str:
    """``gzip``, ``zstd`` or ``none``, from the blob's first bytes (media types are not trusted)."""
    with open(blob, "rb") as f:
        head = f.read(4)
    if head.startswith(_GZIP_MAGIC):
        return "gzip"
    return "zstd" if head == _ZSTD_MAGIC else "none"


@contextlib.contextmanager
def _tar_stream(blob: Path) -> Iterator[IO[bytes]]:
    """The blob's uncompressed tar bytes as a stream; zstd goes through the zstd tool."""
    kind = compression(blob)
    if kind == "gzip":
        with gzip.open(blob, "rb") as stream:
            yield stream
    elif kind == "zstd":
        with subprocess.Popen(
            ["zstd", "-d", "-c", "-q", str(blob)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        ) as proc:
            assert proc.stdout is not None
            try:
                yield proc.stdout
            finally:
                proc.stdout.close()
                proc.kill()
            if proc.wait() not in (0, -9):
                raise LayerRefused(f"layer {blob.name}: zstd failed: {proc.stderr.read().decode()[:200]}")
    else:
        with open(blob, "rb") as stream:
            yield stream


class _LayerReader:
    """The tar stream as tarfile reads it: hashed for the diff_id, and bounded at its end.

    tarfile skips an entry's data by reading it, even past the end of the stream, so a tiny
    layer whose header claims exabytes would keep it reading nothing for hours; a second read
    at the end of the stream therefore ends the layer instead.
    """

    def __init__(self, stream: IO[bytes]):
        self._stream = stream
        self._hash = hashlib.sha256()
        self._ended = False

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        if not data and size:
            if self._ended:
                raise EOFError("the layer ends inside an entry")
            self._ended = True
        self._hash.update(data)
        return data

    def drain(self) -> None:
        """Hash what tarfile left unread (end-of-archive padding)."""
        while not self._ended:
            self.read(_CHUNK)

    @property
    def digest(self) -> str:
        return "sha256:" + self._hash.hexdigest()


@dataclass
class SizeBudget:
    """Bytes of regular-file content an image may still unpack to."""

    left: int

    def take(self, size: int, name: str) -> None:
        self.left -= size
        if self.left < 0:
            raise LayerRefused(f"{name}: the image unpacks to more than the allowed size")


def _parts(name: str, what: str) -> list[str]:
    """Path components of an entry name, relative to the root; ``..`` refuses the layer."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise LayerRefused(f"{what} {name!r} contains '..'")
    return parts


@dataclass
class _Tree:
    """The root being unpacked into, addressed only through descriptors."""

    root_fd: int
    budget: SizeBudget
    chown: bool = field(default_factory=lambda: os.geteuid() == 0)
    _deferred: list[tuple[list[str], tarfile.TarInfo]] = field(default_factory=list)

    def walk(self, parts: list[str], *, create: bool, what: str) -> int | None:
        """A new descriptor of the directory ``parts`` names inside the root (chroot semantics).

        Missing directories are created when ``create`` (mode 0755, as Docker does), else None
        is returned. A component that is neither a directory nor a symlink refuses the layer.
        """
        stack = [self.root_fd]
        todo = list(reversed(parts))
        links = 0
        try:
            while todo:
                name = todo.pop()
                if name in ("", "."):
                    continue
                if name == "..":
                    if len(stack) > 1:
                        os.close(stack.pop())
                    continue
                try:
                    stack.append(os.open(name, _DIR, dir_fd=stack[-1]))
                except FileNotFoundError:
                    if not create:
                        return None
                    stack.append(self._mkdir(stack[-1], name))
                except OSError as exc:
                    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    if not stat.S_ISLNK(os.stat(name, dir_fd=stack[-1], follow_symlinks=False).st_mode):
                        raise LayerRefused(f"{what}: {name!r} on its path is not a directory") from None
                    links += 1
                    if links > MAX_SYMLINKS:
                        raise LayerRefused(f"{what}: too many levels of symbolic links") from None
                    target = os.readlink(name, dir_fd=stack[-1])
                    if target.startswith("/"):
                        while len(stack) > 1:
                            os.close(stack.pop())
                    todo.extend(reversed(target.split("/")))
            return stack.pop() if len(stack) > 1 else os.dup(self.root_fd)
        finally:
            for fd in stack[1:]:
                os.close(fd)

    @staticmethod
    def _mkdir(parent: int, name: str) -> int:
        os.mkdir(name, 0o755, dir_fd=parent)
        fd = os.open(name, _DIR, dir_fd=parent)
        os.fchmod(fd, 0o755)
        return fd

    def apply_whiteouts(self, tar: tarfile.TarFile) -> None:
        """First pass: remove what this layer's whiteouts hide from the layers below."""
        for member in _entries(tar):
            parts = _parts(member.name, "entry")
            if not parts or not parts[-1].startswith(WHITEOUT):
                continue
            base = parts[-1]
            hidden = None if base == OPAQUE else base[len(WHITEOUT) :]
            if hidden is not None and (hidden in ("", ".", "..") or hidden.startswith(WHITEOUT)):
                continue  # aufs bookkeeping (.wh..wh.plnk) or an empty name: nothing to hide
            parent = self.walk(parts[:-1], create=False, what=member.name)
            if parent is None:
                continue
            try:
                for name in os.listdir(parent) if hidden is None else [hidden]:
                    _remove(parent, name)
            finally:
                os.close(parent)

    def extract(self, tar: tarfile.TarFile) -> None:
        """Second pass: create every entry, then set directory modes and times."""
        self._deferred.clear()
        for member in _entries(tar):
            parts = _parts(member.name, "entry")
            if parts and parts[-1].startswith(WHITEOUT):
                continue
            try:
                self._entry(tar, member, parts)
            except OSError as exc:
                raise LayerRefused(f"{member.name}: {exc.strerror or exc}") from None
            except (OverflowError, ValueError) as exc:  # absurd ids or times, NUL in a name
                raise LayerRefused(f"{member.name}: {exc}") from None
        for parts, member in reversed(self._deferred):
            try:
                self._finish_directory(parts, member)
            except (OSError, OverflowError, ValueError) as exc:
                raise LayerRefused(f"{member.name}: {exc}") from None

    def _entry(self, tar: tarfile.TarFile, member: tarfile.TarInfo, parts: list[str]) -> None:
        if not parts:
            if member.isdir():  # the root itself: only its metadata
                self._deferred.append((parts, member))
            return
        if member.ischr() or member.isblk():
            log.info("skipping device node %s", member.name)
            return
        if not (member.isreg() or member.isdir() or member.issym() or member.islnk() or member.isfifo()):
            log.info("skipping %s of unsupported type %r", member.name, member.type)
            return
        parent = self.walk(parts[:-1], create=True, what=member.name)
        assert parent is not None
        try:
            self._create(tar, member, parent, parts[-1])
        finally:
            os.close(parent)
        if member.isdir():
            self._deferred.append((parts, member))

    def _create(self, tar: tarfile.TarFile, member: tarfile.TarInfo, parent: int, name: str) -> None:
        try:
            existing = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
        except FileNotFoundError:
            existing = None
        if existing is not None and not (member.isdir() and stat.S_ISDIR(existing)):
            _remove(parent, name)
        if member.isreg():
            self._write_file(tar, member, parent, name)
        elif member.isdir():
            if existing is None or not stat.S_ISDIR(existing):
                os.mkdir(name, 0o700, dir_fd=parent)
            fd = os.open(name, _DIR, dir_fd=parent)
            try:
                self._own(fd, member)
                _set_xattrs(fd, member)
            finally:
                os.close(fd)
        elif member.issym():
            os.symlink(member.linkname, name, dir_fd=parent)
            if self.chown:
                os.chown(name, member.uid, member.gid, dir_fd=parent, follow_symlinks=False)
            os.utime(name, (member.mtime, member.mtime), dir_fd=parent, follow_symlinks=False)
        elif member.islnk():
            self._hardlink(member, parent, name)
        else:  # FIFO
            os.mkfifo(name, 0o600, dir_fd=parent)
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
            try:
                self._own(fd, member)
                os.fchmod(fd, member.mode & 0o7777)
            finally:
                os.close(fd)

    def _write_file(self, tar: tarfile.TarFile, member: tarfile.TarInfo, parent: int, name: str) -> None:
        self.budget.take(member.size, member.name)
        source = tar.extractfile(member)
        assert source is not None
        with open(os.open(name, _NEW_FILE, 0o600, dir_fd=parent), "wb") as out:
            shutil.copyfileobj(source, out, _CHUNK)
            out.flush()
            self._own(out.fileno(), member)
            os.fchmod(out.fileno(), member.mode & 0o7777)  # after chown, which clears setuid
            _set_xattrs(out.fileno(), member)
            os.utime(out.fileno(), (member.mtime, member.mtime))

    def _hardlink(self, member: tarfile.TarInfo, parent: int, name: str) -> None:
        target = _parts(member.linkname, "hardlink target")
        if not target:
            raise LayerRefused(f"{member.name}: hardlink to the root directory")
        source_dir = self.walk(target[:-1], create=False, what=member.name)
        if source_dir is None:
            raise LayerRefused(f"{member.name}: hardlink target {member.linkname!r} does not exist")
        try:
            os.link(target[-1], name, src_dir_fd=source_dir, dst_dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            raise LayerRefused(f"{member.name}: hardlink target {member.linkname!r} does not exist") from None
        except (PermissionError, IsADirectoryError):
            raise LayerRefused(f"{member.name}: hardlink target {member.linkname!r} is a directory") from None
        finally:
            os.close(source_dir)

    def _own(self, fd: int, member: tarfile.TarInfo) -> None:
        if self.chown:
            os.fchown(fd, member.uid, member.gid)

    def _finish_directory(self, parts: list[str], member: tarfile.TarInfo) -> None:
        """Mode and times of a directory, once nothing more is written into it in this layer."""
        if parts:
            parent = self.walk(parts[:-1], create=False, what=member.name)
            if parent is None:
                return  # removed later in the same layer
            try:
                fd = os.open(parts[-1], _DIR, dir_fd=parent)
            except OSError:
                return  # replaced by a non-directory later in the same layer
            finally:
                os.close(parent)
        else:
            fd = os.dup(self.root_fd)
            self._own(fd, member)
        try:
            os.fchmod(fd, member.mode & 0o7777)
            os.utime(fd, (member.mtime, member.mtime))
        finally:
            os.close(fd)


def _entries(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """The members one by one, without tarfile keeping every one seen (layers can be huge)."""
    while (member := tar.next()) is not None:
        tar.members.clear()
        yield member


def _remove(parent: int, name: str) -> None:
    """Remove ``name`` (a whole tree if a directory) from a directory, never following a symlink."""
    try:
        mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(name, dir_fd=parent)
    else:
        os.unlink(name, dir_fd=parent)


def _set_xattrs(fd: int, member: tarfile.TarInfo) -> None:
    for key, value in member.pax_headers.items():
        if not key.startswith("SCHILY.xattr."):
            continue
        name = key.removeprefix("SCHILY.xattr.")
        if name.startswith(XATTR_PREFIXES) or name in XATTR_NAMES:
            os.setxattr(fd, name, value.encode("utf-8", "surrogateescape"))
