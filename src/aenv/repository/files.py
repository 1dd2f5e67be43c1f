"""Blob files: hashing, copying and writing them without reading or writing their holes.

Memory images are mostly holes: a 2 GiB image of a fresh guest holds a few hundred MiB of data,
so every pass over a blob file (its digest, a copy, a download) follows its data regions and
keeps zeros as holes. Both backends and the node's runtime tier use these.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from .errors import DigestMismatch

CHUNK = 1 << 20
_ZERO_BYTES = bytes(CHUNK)
_ZEROS = memoryview(_ZERO_BYTES)


def data_extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each data region of an open file; holes in between read as zeros.

    Filesystems without hole tracking report the whole file as data, which is still correct.
    """
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole is left
                return
            if exc.errno != errno.EINVAL:
                raise
            yield pos, size  # SEEK_DATA unsupported here
            return
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        yield start, end
        pos = end


def _read_range(fd: int, start: int, end: int, buf: bytearray) -> Iterator[memoryview]:
    view = memoryview(buf)
    pos = start
    while pos < end:
        n = os.preadv(fd, [view[: min(CHUNK, end - pos)]], pos)
        if n == 0:
            return  # truncated under us; the caller's length check reports it
        yield view[:n]
        pos += n


def file_digest(path: Path) -> str:
    """sha256 of a file's full contents, reading only its data regions (holes hash as zeros)."""
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        pos = 0
        for start, end in data_extents(f.fileno(), size):
            _hash_zeros(h, start - pos)
            pos = start
            for chunk in _read_range(f.fileno(), start, end, buf):
                h.update(chunk)
                pos += len(chunk)
        _hash_zeros(h, size - pos)
    return "sha256:" + h.hexdigest()


def _hash_zeros(h: hashlib._Hash, count: int) -> None:
    while count > 0:
        n = min(count, CHUNK)
        h.update(_ZEROS[:n])
        count -= n


def sparse_copy(src: Path, dst: Path) -> None:
    """Copy ``src`` to a new file ``dst`` writing only non-zero data, so holes stay holes."""
    buf = bytearray(CHUNK)
    with open(src, "rb", buffering=0) as fin, open(dst, "xb", buffering=0) as fout:
        size = os.fstat(fin.fileno()).st_size
        for start, end in data_extents(fin.fileno(), size):
            pos = start
            for chunk in _read_range(fin.fileno(), start, end, buf):
                # bytes == bytes is a memcmp; comparing memoryviews is ~60x slower
                if chunk.tobytes() != _ZERO_BYTES[: len(chunk)]:
                    os.pwrite(fout.fileno(), chunk, pos)
                pos += len(chunk)
        os.ftruncate(fout.fileno(), size)
        os.fsync(fout.fileno())


def check_fetched(path: Path, digest: str) -> None:
    """Remove ``path`` and raise ``DigestMismatch`` unless its bytes hash to ``digest``."""
    actual = file_digest(path)
    if actual != digest:
        path.unlink(missing_ok=True)
        raise DigestMismatch(f"blob {digest} is corrupt: its contents hash to {actual}")


def write_fetched(dest: Path, chunks: Iterable[bytes], digest: str) -> None:
    """Write a downloaded blob to the new file `dest`, zero chunks left as holes, and check it.

    Whatever the source (the object store, a peer), `dest` is removed unless its bytes hash to
    `digest`, so a caller keeps only verified blobs.
    """
    try:
        with open(dest, "xb", buffering=0) as f:
            pos = 0
            for chunk in chunks:
                if chunk != _ZERO_BYTES[: len(chunk)]:
                    os.pwrite(f.fileno(), chunk, pos)
                pos += len(chunk)
            os.ftruncate(f.fileno(), pos)
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    check_fetched(dest, digest)
