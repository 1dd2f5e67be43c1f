"""Delta layers captured from a live private file mapping (this test process's own)."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from pathlib import Path

import pytest

from aenv.repository.files import file_digest
from aenv.repository.posix import SnapshotRepository
from aenv.snapshot import memory

PAGES = 64


def private_mapping(image: Path) -> tuple[mmap.mmap, int, int]:
    """A copy-on-write mapping of `image`, as QEMU maps a memory image, and its address range."""
    with open(image, "rb") as f:
        mapping = mmap.mmap(f.fileno(), PAGES * memory.PAGE_SIZE, flags=mmap.MAP_PRIVATE)
    start = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    return mapping, start, start + len(mapping)


def test_capture_holds_exactly_the_written_pages_and_their_digest(tmp_path: Path) -> None:
    image = tmp_path / "memory.img"
    image.write_bytes(bytes(range(256)) * (PAGES * memory.PAGE_SIZE // 256))
    source, start, end = private_mapping(image)
    assert memory.find_mapping(os.getpid(), image) == (start, end)
    written = [3, 4, 5, 40]
    for page in written:
        source[page * memory.PAGE_SIZE : (page + 1) * memory.PAGE_SIZE] = bytes([page]) * memory.PAGE_SIZE

    info = memory.capture_delta(os.getpid(), start, end, tmp_path / "delta")
    assert info.pages == len(written)
    assert info.digest == file_digest(info.path)  # hashed while written, so stored without a re-read

    target, start, end = private_mapping(image)
    memory.apply_deltas(os.getpid(), start, end, [info.path])
    assert target[:] == source[:]
    assert image.read_bytes() != source[:]  # the image itself never changes

    repository = SnapshotRepository(tmp_path / "repository")
    assert repository.put_blob(info.path, digest=info.digest, move=True, verify=False) == info.digest


def test_a_stopped_capture_raises_and_writes_no_more(tmp_path: Path) -> None:
    image = tmp_path / "memory.img"
    image.write_bytes(bytes(PAGES * memory.PAGE_SIZE))
    source, start, end = private_mapping(image)
    source[: memory.PAGE_SIZE] = b"x" * memory.PAGE_SIZE
    stop = threading.Event()
    stop.set()
    with pytest.raises(memory.CaptureStopped):
        memory.capture_delta(os.getpid(), start, end, tmp_path / "delta", stop=stop)
    assert (tmp_path / "delta").stat().st_size == 2 * memory.PAGE_SIZE  # header and page index, no page
    stop.clear()
    assert memory.capture_delta(os.getpid(), start, end, tmp_path / "delta", stop=stop).pages == 1
