"""Blobs in verified chunks: what lets a node use a blob before all of it is here.

A large blob stored in a remote repository gets a chunk index beside it, written by the node
that stores it from the same bytes: the blob's size, the chunk size, and the sha256 of each
chunk (None for a chunk of zeros, which is never fetched: memory images are mostly holes).
A reader then keeps a sparse local copy (`ChunkFile`) and fills it a chunk at a time from
ranged reads of the repository, each chunk checked against its index entry before it is
written; a chunk that does not match is an error for the reader (`ChunkMismatch`), never
served. Consecutive missing chunks are fetched as one range (`runs`), so a restore's
prefetch costs a few requests.

A chunk the local copy already holds is trusted only after it has been rehashed once by this
process: the copy may have been written by another process (the node's prefetch, an earlier
run killed mid-write), so presence alone proves nothing. A hole reads as zeros and fails the
check, so no separate record of which chunks are present is needed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .errors import RepositoryError
from .files import data_extents

CHUNK_SIZE = 256 << 10  # two FUSE reads; a restore touches scattered pages, so small chunks pay
MAX_RUN = 32  # chunks in one ranged read (8 MiB)
PARALLEL_RUNS = 16  # ranged reads in flight during a prefetch

Fetch = Callable[[int, int], bytes]  # (offset, length) of the blob -> exactly those bytes


class ChunkMismatch(RepositoryError):
    """A chunk read from the repository does not hash to its index entry."""


@dataclass(frozen=True)
class ChunkIndex:
    """A blob's size and the sha256 (hex) of each of its chunks; None for chunks of zeros."""

    size: int
    chunk_size: int
    digests: tuple[str | None, ...]

    def __post_init__(self) -> None:
        if self.size < 0 or self.chunk_size <= 0 or len(self.digests) != -(-self.size // self.chunk_size):
            raise ValueError("chunk index does not match its size")

    @classmethod
    def build(cls, path: Path, chunk_size: int = CHUNK_SIZE) -> ChunkIndex:
        """The index of a local file; holes are skipped, not read."""
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            count = -(-size // chunk_size)
            data: set[int] = set()
            for start, end in data_extents(f.fileno(), size):
                data.update(range(start // chunk_size, -(-end // chunk_size)))
            digests: list[str | None] = [None] * count
            zeros = bytes(chunk_size)
            for i in sorted(data):
                chunk = os.pread(f.fileno(), chunk_size, i * chunk_size)
                if chunk != zeros[: len(chunk)]:
                    digests[i] = hashlib.sha256(chunk).hexdigest()
        return cls(size, chunk_size, tuple(digests))

    def to_json(self) -> bytes:
        fields = {"size": self.size, "chunk_size": self.chunk_size, "digests": self.digests}
        return json.dumps(fields).encode()

    @classmethod
    def from_json(cls, data: bytes) -> ChunkIndex:
        try:
            raw = json.loads(data)
            return cls(int(raw["size"]), int(raw["chunk_size"]), tuple(raw["digests"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise RepositoryError(f"unreadable chunk index: {exc}") from exc

    def span(self, i: int) -> tuple[int, int]:
        """(offset, length) of chunk `i`."""
        start = i * self.chunk_size
        return start, min(self.chunk_size, self.size - start)

    def chunks_of(self, offset: int, length: int) -> range:
        """The chunks a read of `length` bytes at `offset` touches."""
        end = min(offset + length, self.size)
        if end <= offset:
            return range(0)
        return range(offset // self.chunk_size, (end - 1) // self.chunk_size + 1)

    def matches(self, i: int, chunk: bytes) -> bool:
        """Whether `chunk` holds exactly chunk `i`'s bytes."""
        expected = self.digests[i]
        return hashlib.sha256(chunk).hexdigest() == (expected or _zero_digest(len(chunk)))

    def verified(self, offset: int, data: bytes) -> bool:
        """Whether `data`, read at `offset`, is whole chunks that each match (so a range from an
        untrusted source can be kept: `aenv.runtime.peers`)."""
        if offset % self.chunk_size or not data or offset + len(data) > self.size:
            return False
        end = offset + len(data)
        if end != self.size and end % self.chunk_size:
            return False
        return all(
            self.matches(i, data[self.span(i)[0] - offset : sum(self.span(i)) - offset])
            for i in self.chunks_of(offset, len(data))
        )

    def data_chunks(self) -> list[int]:
        return [i for i, d in enumerate(self.digests) if d is not None]


def runs(chunks: Iterable[int], max_run: int = MAX_RUN) -> list[tuple[int, int]]:
    """Sorted chunk numbers as ``(first, count)`` runs of consecutive ones, at most `max_run` long."""
    found: list[tuple[int, int]] = []
    for i in sorted(set(chunks)):
        if found and found[-1][0] + found[-1][1] == i and found[-1][1] < max_run:
            found[-1] = (found[-1][0], found[-1][1] + 1)
        else:
            found.append((i, 1))
    return found


@functools.cache
def _zero_digest(length: int) -> str:
    return hashlib.sha256(bytes(length)).hexdigest()


def held_chunks(path: Path, index: ChunkIndex) -> list[int]:
    """Data chunks a local copy holds something of (what its readers fetched so far)."""
    with contextlib.suppress(FileNotFoundError), open(path, "rb", buffering=0) as f:
        held = {i for s, e in data_extents(f.fileno(), index.size) for i in index.chunks_of(s, e - s)}
        return sorted(i for i in held if index.digests[i] is not None)
    return []


class ChunkFile:
    """A blob's sparse local copy at `path`, filled from `fetch` chunk by chunk, verified.

    Safe for threads. The copy is made by its cache (`BlobCache.get_partial`), never here: once
    the cache dropped it (an evicted entry), reads are served from verified fetches without
    keeping them, so no file the cache does not know about ever appears. Reads never go past the
    blob's size.
    """

    def __init__(self, path: Path, index: ChunkIndex, fetch: Fetch):
        self.path = path
        self.index = index
        self._fetch = fetch
        self._lock = threading.Lock()
        self._chunk_locks: dict[int, threading.Lock] = {}
        self._verified: set[int] = set()
        self._inode: int | None = None
        self.fetched_bytes = 0

    def read(self, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` (fewer at the end of the blob), fetching what is missing."""
        end = min(offset + length, self.index.size)
        if end <= offset:
            return b""
        fd = self._open()
        if fd is None:
            return self._uncached(offset, end)
        try:
            self._ensure(fd, self.index.chunks_of(offset, length))
            data = os.pread(fd, end - offset, offset)
            # The reader (the FUSE file's page cache) keeps these pages: one copy per node.
            os.posix_fadvise(fd, offset, end - offset, os.POSIX_FADV_DONTNEED)
            return data
        finally:
            os.close(fd)

    def prefetch(self, chunks: Iterable[int], parallel: int = PARALLEL_RUNS) -> None:
        """Make `chunks` local, the missing ones fetched in runs, `parallel` runs at a time."""
        fd = self._open()
        if fd is None:
            return  # dropped by its cache: nothing to keep the chunks in
        try:
            missing = [i for i in chunks if not self._present(fd, i)]
            with ThreadPoolExecutor(max_workers=parallel) as pool:
                list(pool.map(lambda run: self._fetch_run(fd, *run), runs(missing)))
        finally:
            os.close(fd)

    # ---- internals -----------------------------------------------------------------------------

    def _uncached(self, offset: int, end: int) -> bytes:
        """Bytes offset..end fetched and verified, for a copy its cache has dropped."""
        first, last = offset // self.index.chunk_size, (end - 1) // self.index.chunk_size
        start = first * self.index.chunk_size
        data = self._fetch(start, min((last + 1) * self.index.chunk_size, self.index.size) - start)
        for i in range(first, last + 1):
            chunk_start, length = self.index.span(i)
            self._check(i, data[chunk_start - start : chunk_start - start + length])
        return data[offset - start : end - start]

    def _check(self, i: int, chunk: bytes) -> None:
        if not self.index.matches(i, chunk):
            offset, length = self.index.span(i)
            raise ChunkMismatch(f"chunk {i} (bytes {offset}..{offset + length}) is corrupt")

    def _open(self) -> int | None:
        """The copy, open for reading and writing; None once its cache has dropped it."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            with self._lock:
                if st.st_ino != self._inode:  # a new file: nothing in it is checked yet
                    self._inode, self._verified = st.st_ino, set()
            if st.st_size != self.index.size:
                os.ftruncate(fd, self.index.size)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _ensure(self, fd: int, chunks: range) -> None:
        missing = [i for i in chunks if not self._present(fd, i)]
        for first, count in runs(missing):
            self._fetch_run(fd, first, count)

    def _present(self, fd: int, i: int) -> bool:
        """Whether chunk `i` is zeros or held and verified locally (rehashed once per file)."""
        digest = self.index.digests[i]
        if digest is None or i in self._verified:
            return True
        offset, length = self.index.span(i)
        if hashlib.sha256(os.pread(fd, length, offset)).hexdigest() != digest:
            return False
        with self._lock:
            self._verified.add(i)
        return True

    def _fetch_run(self, fd: int, first: int, count: int) -> None:
        """Fetch chunks first..first+count-1 in one read, verify each, write those not yet held."""
        locks = [self._chunk_lock(i) for i in range(first, first + count)]
        for lock in locks:
            lock.acquire()
        try:
            todo = [i for i in range(first, first + count) if not self._present(fd, i)]
            if not todo:
                return
            start = self.index.span(todo[0])[0]
            end = sum(self.index.span(todo[-1]))
            data = self._fetch(start, end - start)
            if len(data) != end - start:
                raise ChunkMismatch(f"short read: {len(data)} bytes at {start}, expected {end - start}")
            for i in todo:
                offset, length = self.index.span(i)
                chunk = data[offset - start : offset - start + length]
                self._check(i, chunk)
                os.pwrite(fd, chunk, offset)
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
            with self._lock:
                self._verified.update(todo)
                self.fetched_bytes += end - start
        finally:
            for lock in locks:
                lock.release()

    def _chunk_lock(self, i: int) -> threading.Lock:
        with self._lock:
            return self._chunk_locks.setdefault(i, threading.Lock())
