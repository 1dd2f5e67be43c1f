"""Guest memory as one immutable image plus per-sandbox delta layers.

A clone maps the image privately (copy-on-write), so the pages a sandbox changed are exactly
the private anonymous pages of that mapping in its QEMU process: `/proc/<pid>/pagemap` tells
which (present and not file-backed), and `/proc/<pid>/mem` reads them. Resume writes them back
into a fresh clone of the same image before the guest runs. Pages never changed stay shared
through the host page cache, which is what makes idle sandboxes cheap. One more kind of change:
runs of pages the guest zeroed that the node remapped as anonymous memory to give them back to
the host (`aenv.vmm.reclaim`) read zero, not the image, whether present or not; they are changed
pages too, and the guest's RAM then spans several mappings.

Delta layer file: a 4 KiB header (magic, page size, page count, memory size), the sorted page
indices as little-endian uint64, padded to a page boundary, then the pages in index order.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import mmap
import os
import struct
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PAGE_SIZE = mmap.PAGESIZE
_MAGIC = b"AENVDLT1"
_HEADER = struct.Struct("<8sIQQ")
_HEADER_SIZE = 4096
_PRESENT = np.uint64(1 << 63)
_FILE_OR_SHARED = np.uint64(1 << 61)
_PFN = (1 << 55) - 1
# A capture looks at its `stop` between runs, and a resume waits for that. Writing a run into page
# cache the host must first get back from its own hypervisor took up to 150 ms with 8 MiB runs
# and up to 20 ms with 1 MiB runs (512 MiB written each way); into reused page cache, 85 MiB took
# 30-31 ms with either size.
_MAX_RUN_BYTES = 1 << 20


class CaptureStopped(Exception):
    """A capture was told to stop before it ended (its guest runs again); its file is partial."""


class DeltaFormatError(ValueError):
    """A delta layer file is damaged or was written for another memory size."""


def find_mapping(pid: int, mem_path: Path) -> tuple[int, int]:
    """Address range of the guest RAM mapping of `mem_path` in process `pid`: the file's size from
    where its first page is (the RAM may be split into several mappings, see above; the first
    page is never remapped)."""
    target = str(mem_path)
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == target:
                start = int(fields[0].split("-")[0], 16) - int(fields[2], 16)
                return start, start + os.stat(mem_path).st_size
    raise LookupError(f"process {pid} has no mapping of {target}")


@functools.cache
def _zero_pfn() -> int:
    """The frame of the kernel's shared zero page, which an anonymous page read before any write
    maps: it holds nothing of the process's own (-1 when pagemap hides frames: not root)."""
    page = mmap.mmap(-1, PAGE_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        view = ctypes.c_char.from_buffer(page)
        address = ctypes.addressof(view)
        _ = view.value  # a read: the zero page is mapped
        del view
        with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
            entry = int.from_bytes(os.pread(pagemap.fileno(), 8, address // PAGE_SIZE * 8), "little")
    finally:
        page.close()
    return entry & _PFN or -1


def dirty_pages(pid: int, start: int, end: int) -> np.ndarray:
    """Indices of pages in [start, end) that are private anonymous: written by the guest (a read
    of a remapped run maps the shared zero page, which is not the process's own)."""
    count = (end - start) // PAGE_SIZE
    with open(f"/proc/{pid}/pagemap", "rb", buffering=0) as pagemap:
        raw = os.pread(pagemap.fileno(), count * 8, start // PAGE_SIZE * 8)
    entries = np.frombuffer(raw, dtype=np.uint64)
    written = (entries & _PRESENT != 0) & (entries & _FILE_OR_SHARED == 0)
    written &= entries & np.uint64(_PFN) != np.uint64(_zero_pfn() % 2**64)
    return np.flatnonzero(written).astype(np.uint64)


def ram_mappings(pid: int, start: int, end: int) -> list[tuple[int, int, bool]]:
    """Each mapping of process `pid` in [start, end): its first and end page index there, and
    whether it is anonymous (a run the node remapped to zero) rather than the image's."""
    found: list[tuple[int, int, bool]] = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if start <= low and high <= end:
                found.append(((low - start) // PAGE_SIZE, (high - start) // PAGE_SIZE, len(fields) == 5))
    return found


def anonymous_pages(mappings: list[tuple[int, int, bool]]) -> np.ndarray:
    """Indices of the pages of the anonymous ones of `mappings` (`ram_mappings`)."""
    parts = [np.arange(first, last, dtype=np.uint64) for first, last, anonymous in mappings if anonymous]
    return np.concatenate(parts) if parts else np.empty(0, np.uint64)


def remapped_pages(pid: int, start: int, end: int) -> np.ndarray:
    """Indices of the pages in [start, end) mapped anonymously: runs the node remapped to zero."""
    return anonymous_pages(ram_mappings(pid, start, end))


def changed_pages(pid: int, start: int, end: int) -> np.ndarray:
    """Indices of every page in [start, end) that does not read as the image: written or remapped."""
    return np.union1d(dirty_pages(pid, start, end), remapped_pages(pid, start, end))


def runs(indices: np.ndarray) -> Iterator[tuple[int, int]]:
    """(first index, length) of each run of consecutive page indices, bounded in size."""
    if indices.size == 0:
        return
    breaks = np.flatnonzero(np.diff(indices) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [indices.size]))
    limit = _MAX_RUN_BYTES // PAGE_SIZE
    for first, last in zip(starts.tolist(), ends.tolist(), strict=True):
        for offset in range(first, last, limit):
            yield int(indices[offset]), min(limit, last - offset)


@dataclass(frozen=True)
class DeltaInfo:
    pages: int
    memory_size: int
    path: Path
    digest: str  # "sha256:…" of the whole file, computed while writing it ("" when not asked for)


def _header(pages: int, memory_size: int) -> bytes:
    return _HEADER.pack(_MAGIC, PAGE_SIZE, pages, memory_size).ljust(_HEADER_SIZE, b"\0")


def _index_area(pages: int) -> int:
    return -(-pages * 8 // PAGE_SIZE) * PAGE_SIZE


def capture_delta(
    pid: int, start: int, end: int, out: Path, *, sync: bool = True, stop: threading.Event | None = None
) -> DeltaInfo:
    """Write the pages the guest changed into a delta layer file. QEMU must be stopped.

    The file is hashed as it is written: a pause stores it by digest, and reading hundreds
    of MiB back just to hash them would cost a third again of the capture. Without `sync` it is
    neither hashed nor flushed: the caller does both after the guest runs again (a snapshot
    committed in the background, `aenv.snapshot.pending`), and the digest is left empty.
    `stop` is looked at before each run of pages and before the flush: once set, the capture
    raises CaptureStopped, and the caller removes the partial file.
    """
    indices = changed_pages(pid, start, end)
    memory_size = end - start
    digest = hashlib.sha256()
    private = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # guest memory: no VMM reads it
    with open(private, "wb") as f, open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:

        def write(data: bytes) -> None:
            if sync:
                digest.update(data)
            f.write(data)

        write(_header(int(indices.size), memory_size))
        write(indices.astype("<u8").tobytes().ljust(_index_area(int(indices.size)), b"\0"))
        for first, length in runs(indices):
            _check(stop)
            write(os.pread(mem.fileno(), length * PAGE_SIZE, start + first * PAGE_SIZE))
        f.flush()
        if sync:
            _check(stop)
            os.fsync(f.fileno())
    return DeltaInfo(int(indices.size), memory_size, out, "sha256:" + digest.hexdigest() if sync else "")


def flush_delta(path: Path) -> None:
    """Make a delta layer written without `sync` durable."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _check(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise CaptureStopped("the capture was stopped")


def read_delta_indices(path: Path) -> tuple[np.ndarray, int]:
    """The page indices of a delta layer and the memory size it was taken from."""
    with open(path, "rb") as f:
        magic, page_size, pages, memory_size = _HEADER.unpack(f.read(_HEADER.size))
        if magic != _MAGIC or page_size != PAGE_SIZE:
            raise DeltaFormatError(f"{path} is not a delta layer for {PAGE_SIZE}-byte pages")
        f.seek(_HEADER_SIZE)
        indices = np.frombuffer(f.read(pages * 8), dtype="<u8").astype(np.uint64)
    if indices.size != pages:
        raise DeltaFormatError(f"{path} is truncated")
    return indices, memory_size


def _check_size(path: Path, memory_size: int, expected: int) -> None:
    if memory_size != expected:
        raise DeltaFormatError(f"{path} holds {memory_size} bytes of memory, the guest has {expected}")


def _layer_chunks(layer: Path, expected_size: int) -> Iterator[tuple[int, bytes]]:
    """(byte offset in guest memory, data) for each run of pages in a delta layer."""
    indices, memory_size = read_delta_indices(layer)
    _check_size(layer, memory_size, expected_size)
    position = _HEADER_SIZE + _index_area(int(indices.size))
    with open(layer, "rb", buffering=0) as f:
        for first, length in runs(indices):
            chunk = os.pread(f.fileno(), length * PAGE_SIZE, position)
            if len(chunk) != length * PAGE_SIZE:
                raise DeltaFormatError(f"{layer} is truncated")
            yield first * PAGE_SIZE, chunk
            position += len(chunk)


def apply_deltas(pid: int, start: int, end: int, layers: Iterable[Path]) -> int:
    """Write delta layers, oldest first, into a stopped clone's RAM; returns bytes written."""
    written = 0
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        for layer in layers:
            for offset, chunk in _layer_chunks(layer, end - start):
                os.pwrite(mem.fileno(), chunk, start + offset)
                written += len(chunk)
    return written
