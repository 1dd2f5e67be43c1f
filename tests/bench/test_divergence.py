"""The divergence figure's split of a QEMU's private memory, on this process's own mappings, and
the figures it derives from the split."""

from __future__ import annotations

import mmap
import subprocess
import sys
from pathlib import Path

import pytest

from bench.divergence import Held, derived_rows, held

GUEST_MIB = 3
PAGE = mmap.PAGESIZE
# Stands in for QEMU: maps the memory image named by the `mem-path=` of its command line
# privately, and a buffer as QEMU's translation buffer is (anonymous, private, executable); on its
# first line read it writes 64 pages of the guest RAM and 256 of the buffer.
CHILD = f"""
import mmap, sys
image = sys.argv[1].split("mem-path=")[1].split(",")[0]
with open(image, "rb") as source:
    guest = mmap.mmap(source.fileno(), {GUEST_MIB << 20}, flags=mmap.MAP_PRIVATE,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
code = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                 prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
print("ready", flush=True)
sys.stdin.readline()
for page in range(64):
    guest[page * {PAGE}] = 1
for page in range(256):
    code[page * {PAGE}] = 1
print("written", flush=True)
sys.stdin.readline()
"""


def test_held_splits_guest_ram_translation_cache_and_the_rest(tmp_path: Path):
    image = tmp_path / "image"
    image.write_bytes(b"\0" * (GUEST_MIB << 20))
    option = f"memory-backend-file,id=mem,size={GUEST_MIB}M,mem-path={image},share=off"
    child = subprocess.Popen([sys.executable, "-c", CHILD, option], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        before = held([child.pid])
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "written"
        after = held([child.pid])
    finally:
        child.kill()
        child.wait()
    assert before is not None and after is not None
    assert (before.guest, after.guest) == (0, pytest.approx(64 * PAGE / 2**20))
    assert after.cache - before.cache == pytest.approx(256 * PAGE / 2**20)
    assert after.cache_unmerged == after.cache  # nothing merged: KSM does not scan this process
    assert after.private == pytest.approx(after.guest + after.cache + after.rest)


def test_held_of_no_process_is_none():
    assert held([]) is None


def test_derived_figures_take_out_what_the_parts_say():
    fresh, diverged = Held(2.0, 10.0, 20.0, 10.0), Held(20.0, 60.0, 25.0, 60.0)
    rows = {row.key: row for row in derived_rows(40.0, 110.0, fresh, diverged, 512)}
    # guest RAM alone: 40 + (20 - 2) = 58 MiB against 40
    assert rows["divergence-ram-guest"].figure.median == pytest.approx(58 / 40)
    # without the translation cache: 110 - 60 = 50 MiB against 40 - 10 = 30
    assert rows["divergence-ram-kvm"].figure.median == pytest.approx(50 / 30)
    assert rows["divergence-overcommit-kvm"].figure.median == pytest.approx(512 / 50)
    assert rows["divergence-ram-kvm"].met is False and rows["divergence-overcommit-kvm"].met is True
