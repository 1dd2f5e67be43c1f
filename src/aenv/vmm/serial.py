"""A guest's serial console, kept by the node as a bounded ring of two files.

QEMU writes the console to a socket the node listens on (a `socket,server=on` chardev), never
to a file: a guest flooding its console (~0.33 MiB/s, forever) would otherwise fill the host's
disk through an append-only file. The node reads the socket (`SerialPump`) and keeps the newest
output in `serial.log` and, before it, `serial.log.1`: once the first holds half the cap and
ends a line, it becomes the second and the older second is dropped.

Lines are numbered from the sandbox's first, across dropped files, so that a page's `start`
(`GET /sandboxes/{id}/logs`) names the same line however much was dropped since: the number of
the first line kept is in `serial.log.start`, which also locks rotation against readers.
While no node reads the socket (a node crashed, before its restart adopts the QEMU), QEMU drops
what the guest writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from ..tasks import cancel

log = logging.getLogger(__name__)

SERIAL_LOG = "serial.log"
OLDER_LOG = "serial.log.1"
FIRST_LINE_FILE = "serial.log.start"
SERIAL_SOCKET = "serial.sock"
# The API's header with the `start` of a page's next page (`GET /sandboxes/{id}/logs`).
NEXT_START_HEADER = "X-Next-Start"
# A line longer than this is cut at a rotation rather than waited for: a guest writing no
# newline must not grow a file past its half of the cap.
MAX_LINE = 64 * 1024
READ_SIZE = 64 * 1024
_APPEND = os.O_RDWR | os.O_CREAT | os.O_APPEND  # read too: the last byte says whether a line ended
# The ring's default size: a boot's console under TCG is ~40 KiB; 8 MiB keeps hours of a chatty
# guest's messages and ~25 s of a flood.
DEFAULT_CAPACITY = 8 * 1024 * 1024
_capacity = DEFAULT_CAPACITY


def set_capacity(mib: int) -> None:
    """Every ring this process opens from now on holds about `mib` MiB (the node's settings)."""
    global _capacity
    _capacity = mib * 1024 * 1024


@contextlib.contextmanager
def _locked(dir_fd: int, operation: int) -> Iterator[int]:
    """`serial.log.start` in the directory `dir_fd`, open and flocked: rotation takes it
    exclusively, readers shared."""
    fd = os.open(FIRST_LINE_FILE, os.O_RDWR | os.O_CREAT, 0o600, dir_fd=dir_fd)
    try:
        fcntl.flock(fd, operation)
        yield fd
    finally:
        os.close(fd)


def _first_line(fd: int) -> int:
    text = os.pread(fd, 32, 0).strip()
    return int(text) if text.isdigit() else 0


def _newlines(path: Path) -> int:
    """The number of line ends in `path` (0 if there is none), read a chunk at a time."""
    try:
        with path.open("rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(READ_SIZE), b""))
    except FileNotFoundError:
        return 0


class SerialRing:
    """The writing end: appends the console's bytes, rotating at half of `capacity`.

    It works in its directory through a descriptor, which follows the directory when it is
    renamed (a warm VM's becomes its sandbox's)."""

    def __init__(self, workdir: Path, capacity: int | None = None):
        self.half = (capacity or _capacity) // 2
        self.older_lines = _newlines(workdir / OLDER_LOG)
        self.lines = _newlines(workdir / SERIAL_LOG)
        self.dir_fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
        self.fd = os.open(SERIAL_LOG, _APPEND, 0o600, dir_fd=self.dir_fd)
        self.size = os.fstat(self.fd).st_size
        self.at_line_end = self.size == 0 or os.pread(self.fd, 1, self.size - 1) == b"\n"

    def write(self, data: bytes) -> None:
        while data:
            if self.size >= self.half and (self.at_line_end or self.size >= self.half + MAX_LINE):
                self._rotate()
            if self.size < self.half:
                piece = data[: self.half - self.size]
            else:  # past half: finish the line, up to MAX_LINE more
                end = data.find(b"\n") + 1 or len(data)
                piece = data[: min(end, self.half + MAX_LINE - self.size)]
            self._append(piece)
            data = data[len(piece) :]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            os.close(self.dir_fd)
            self.fd = -1

    def _append(self, piece: bytes) -> None:
        view = memoryview(piece)
        while view:
            view = view[os.write(self.fd, view) :]
        self.size += len(piece)
        self.lines += piece.count(b"\n")
        self.at_line_end = piece.endswith(b"\n")

    def _rotate(self) -> None:
        with _locked(self.dir_fd, fcntl.LOCK_EX) as lock:
            first = _first_line(lock) + self.older_lines
            os.pwrite(lock, f"{first:<20}\n".encode(), 0)
            os.replace(SERIAL_LOG, OLDER_LOG, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
            os.close(self.fd)
            self.fd = os.open(SERIAL_LOG, _APPEND, 0o600, dir_fd=self.dir_fd)
        self.older_lines, self.lines, self.size, self.at_line_end = self.lines, 0, 0, True


def read_lines(workdir: Path, start: int, limit: int) -> tuple[int, list[str]]:
    """Up to `limit` whole lines from line number `start` (counted from the sandbox's first),
    oldest first, and the number of the first of them: a `start` before the oldest line kept
    starts there. Reads the files a line at a time and keeps only the page, so memory stays
    within the page whatever the ring holds."""
    try:
        dir_fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return start, []
    files: list[BinaryIO] = []
    try:
        with _locked(dir_fd, fcntl.LOCK_SH) as lock:
            number = _first_line(lock)
            for name in (OLDER_LOG, SERIAL_LOG):
                with contextlib.suppress(FileNotFoundError):
                    files.append(os.fdopen(os.open(name, os.O_RDONLY, dir_fd=dir_fd), "rb"))
        first = max(start, number)
        page: list[str] = []
        for line in _whole_lines(files):
            if number >= start:
                page.append(line.rstrip(b"\r\n").decode(errors="replace"))
                if len(page) == limit:
                    break
            number += 1
        return first, page
    finally:
        for f in files:
            f.close()
        os.close(dir_fd)


def _whole_lines(files: list[BinaryIO]) -> Iterator[bytes]:
    """The lines ended by a newline, across the files in order (a line cut by a rotation is
    joined again); an unfinished last line is left for a later read."""
    pending = b""
    for f in files:
        for piece in f:
            if piece.endswith(b"\n"):
                yield pending + piece
                pending = b""
            else:
                pending += piece


class SerialPump:
    """Reads a QEMU's serial socket into its ring until QEMU closes it (or `stop`)."""

    def __init__(self, workdir: Path, sock: socket.socket):
        self.ring = SerialRing(workdir)
        self.sock = sock
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"serial-{workdir.name}")

    @classmethod
    def connect(cls, workdir: Path, path: str) -> SerialPump | None:
        """A pump on the listening socket at `path` (QEMU accepts it once its main loop runs);
        None if there is none (a QEMU started by an older node writes its console to a file)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            log.warning("no serial console socket in %s: %s", workdir, exc)
            return None
        sock.setblocking(False)
        return cls(workdir, sock)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while data := await loop.sock_recv(self.sock, READ_SIZE):
                self.ring.write(data)
        except OSError as exc:
            log.warning("reading a serial console failed: %s", exc)
        finally:
            self._close()

    def move(self, workdir: Path) -> None:
        """Write into `workdir`'s log from now on (a VM started aside becomes a sandbox's)."""
        self.ring.close()
        self.ring = SerialRing(workdir)

    async def stop(self) -> None:
        await cancel(self.task)
        self._close()  # also when the task was cancelled before it ran

    def _close(self) -> None:
        self.sock.close()
        self.ring.close()
