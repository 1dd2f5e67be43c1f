"""Dropping a process's private pages equal to the file it maps (aenv.vmm.reclaim), without a VM:
a child process stands in for QEMU, with a private mapping of a read-only "memory image"."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from aenv.snapshot.memory import PAGE_SIZE, find_mapping
from aenv.vmm import reclaim

SIZE = 16 << 20
# Writes every page, puts the first half back to the file's content (zero), then on each line read
# answers the sum of one byte per page: what the process still reads after the drop.
CHILD = f"""
import mmap, os, sys
m = mmap.mmap(os.open(sys.argv[1], os.O_RDONLY), {SIZE}, flags=mmap.MAP_PRIVATE,
              prot=mmap.PROT_READ | mmap.PROT_WRITE)
for i in range(0, {SIZE}, 4096): m[i] = 1
for i in range(0, {SIZE} // 2, 4096): m[i] = 0
print("ready", flush=True)
for _ in sys.stdin: print(sum(m[i] for i in range(0, {SIZE}, 4096)), flush=True)
"""


def test_pages_equal_to_the_image_are_dropped_and_the_rest_kept(tmp_path: Path) -> None:
    image = tmp_path / "memory"
    image.write_bytes(bytes(SIZE))
    image.chmod(0o444)
    before = hashlib.sha256(image.read_bytes()).hexdigest()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(image)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        start, end = find_mapping(child.pid, image)
        found = reclaim.scan(child.pid, start, end, image)
        pages = SIZE // PAGE_SIZE
        assert (found.private_pages, found.candidates.size) == (pages, pages // 2)
        assert reclaim.settle(child.pid, start, image, found.candidates) == pages // 2
        assert reclaim.private_mib(child.pid, start, end) == SIZE / 2 / 2**20
        child.stdin.write("sum\n")
        child.stdin.flush()
        assert int(child.stdout.readline()) == pages // 2  # it reads what it wrote, and runs on
    finally:
        child.kill()
        child.wait()
    assert hashlib.sha256(image.read_bytes()).hexdigest() == before
