"""Giving a process's private pages back to the host (aenv.vmm.reclaim), without a VM: a child
process stands in for QEMU, with a private mapping of a read-only "memory image"."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from aenv.snapshot import memory
from aenv.snapshot.memory import PAGE_SIZE, find_mapping
from aenv.vmm import reclaim

SIZE = 16 << 20
PAGES = SIZE // PAGE_SIZE
QUARTER = PAGES // 4
# The image: zero in its first half, 7 in every byte of its second half. The child writes 1 into
# each page of the first quarter and then 0 (back to the image), 1 into the second quarter (kept),
# zero over each whole page of the third (zeroed, unlike the image) and leaves the fourth alone.
# Then, for each line read: "sum" answers the sum of one byte per page (what it reads now),
# "set N V" writes V into page N, "zero N K" zeroes K pages from page N.
CHILD = f"""
import mmap, os, sys
m = mmap.mmap(os.open(sys.argv[1], os.O_RDONLY), {SIZE}, flags=mmap.MAP_PRIVATE,
              prot=mmap.PROT_READ | mmap.PROT_WRITE)
q = {QUARTER} * 4096
for i in range(0, 2 * q, 4096): m[i] = 1
for i in range(0, q, 4096): m[i] = 0
m[2 * q:3 * q] = bytes(q)
print("ready", flush=True)
for line in sys.stdin:
    word, *args = line.split()
    if word == "set": m[int(args[0]) * 4096] = int(args[1])
    if word == "zero": n, k = int(args[0]), int(args[1]); m[n * 4096:(n + k) * 4096] = bytes(4096 * k)
    print(sum(m[i] for i in range(0, {SIZE}, 4096)), flush=True)
"""


class Child:
    def __init__(self, image: Path):
        self.process = subprocess.Popen([sys.executable, "-c", CHILD, str(image)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert self.process.stdout is not None and self.process.stdout.readline().strip() == "ready"
        self.pid = self.process.pid

    def ask(self, line: str) -> int:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        return int(self.process.stdout.readline())

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture
def image(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "memory"
    path.write_bytes(bytes(SIZE // 2) + b"\x07" * (SIZE // 2))
    path.chmod(0o444)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    yield path
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before  # never written


@pytest.fixture
def child(image: Path) -> Iterator[Child]:
    process = Child(image)
    yield process
    process.close()


def test_pages_reading_as_the_image_are_dropped_zeroed_ones_remapped_the_rest_kept(
    image: Path, child: Child, tmp_path: Path
) -> None:
    start, end = find_mapping(child.pid, image)
    found = reclaim.scan(child.pid, start, end, image)
    assert found.private_pages == 3 * QUARTER
    assert (found.droppable.size, found.zeroed.size) == (QUARTER, QUARTER)
    assert reclaim.settle(child.pid, found, image) == 2 * QUARTER
    assert find_mapping(child.pid, image) == (start, end)  # the whole RAM, now in three mappings
    remapped = memory.remapped_pages(child.pid, start, end)
    assert np.array_equal(remapped, np.arange(2 * QUARTER, 3 * QUARTER, dtype=np.uint64))
    assert reclaim.private_mib(child.pid, start, end) == QUARTER * PAGE_SIZE / 2**20
    assert child.ask("sum") == QUARTER + 7 * QUARTER  # it reads what it wrote, and runs on

    # A remapped page written is private again, and once zeroed again it goes back by a drop.
    assert child.ask(f"set {2 * QUARTER} 3") == QUARTER * 8 + 3
    again = reclaim.scan(child.pid, start, end, image)
    assert (again.droppable.size, again.zeroed.size) == (0, 0)
    assert child.ask(f"set {2 * QUARTER} 0") == QUARTER * 8
    assert reclaim.settle(child.pid, reclaim.scan(child.pid, start, end, image), image) == 1

    # A capture holds the remapped runs as zero pages: a fresh mapping with it applied reads alike.
    child.ask(f"set {2 * QUARTER + 1} 5")
    delta = memory.capture_delta(child.pid, start, end, tmp_path / "delta")
    assert delta.pages == 2 * QUARTER  # the kept quarter and the remapped one
    other = Child(image)
    try:
        memory.apply_deltas(other.pid, *find_mapping(other.pid, image), [delta.path])
        assert other.ask("sum") == child.ask("sum") == QUARTER * 8 + 5
    finally:
        other.close()


def test_a_pass_remaps_its_longest_runs_within_the_mapping_budget(
    image: Path, child: Child, monkeypatch: pytest.MonkeyPatch
) -> None:
    start, end = find_mapping(child.pid, image)
    reclaim.settle(child.pid, reclaim.scan(child.pid, start, end, image), image)
    child.ask(f"zero {3 * QUARTER} 1")  # two more zeroed runs in the fourth quarter: 1 and 8 pages
    child.ask(f"zero {3 * QUARTER + 10} 8")
    monkeypatch.setattr(reclaim, "MAX_MAPPINGS", len(memory.ram_mappings(child.pid, start, end)) + 2)
    assert reclaim.settle(child.pid, reclaim.scan(child.pid, start, end, image), image) == 8
    assert memory.remapped_pages(child.pid, start, end).size == QUARTER + 8
    assert child.ask("sum") == QUARTER + 7 * (QUARTER - 9)
