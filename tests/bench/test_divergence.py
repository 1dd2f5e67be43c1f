"""The divergence figure's split of a QEMU's private memory, on this process's own mappings, and
the figures it derives from the split."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from bench.divergence import Held, derived_rows, held

GUEST_MIB = 3  # a size no other file mapping of the test process has
PAGE = mmap.PAGESIZE


def test_held_splits_guest_ram_translation_cache_and_the_rest(tmp_path: Path):
    image = tmp_path / "image"
    image.write_bytes(b"\0" * (GUEST_MIB << 20))
    before = held([os.getpid()], GUEST_MIB)
    assert before is not None
    with open(image, "rb") as source:
        guest = mmap.mmap(source.fileno(), GUEST_MIB << 20, flags=mmap.MAP_PRIVATE,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE)  # fmt: skip
    # what QEMU's translation buffer is: an anonymous private mapping, readable, writable, executable
    code = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                     prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)  # fmt: skip
    try:
        for page in range(64):  # 256 KiB of the guest RAM written: private copies of the image
            guest[page * PAGE] = 1
        for page in range(256):  # 1 MiB of translated code
            code[page * PAGE] = 1
        after = held([os.getpid()], GUEST_MIB)
    finally:
        guest.close()
        code.close()
    assert after is not None
    assert after.guest == pytest.approx(64 * PAGE / 2**20)
    assert after.cache - before.cache == pytest.approx(256 * PAGE / 2**20)
    assert after.cache_unmerged == after.cache  # nothing merged: KSM does not scan this process
    assert after.private == pytest.approx(after.guest + after.cache + after.rest)


def test_held_of_no_process_is_none():
    assert held([], GUEST_MIB) is None


def test_derived_figures_take_out_what_the_parts_say():
    fresh, diverged = Held(2.0, 10.0, 20.0, 10.0), Held(20.0, 60.0, 25.0, 60.0)
    rows = {row.key: row for row in derived_rows(40.0, 110.0, fresh, diverged, 512)}
    # guest RAM alone: 40 + (20 - 2) = 58 MiB against 40
    assert rows["divergence-ram-guest"].figure.median == pytest.approx(58 / 40)
    # without the translation cache: 110 - 60 = 50 MiB against 40 - 10 = 30
    assert rows["divergence-ram-kvm"].figure.median == pytest.approx(50 / 30)
    assert rows["divergence-overcommit-kvm"].figure.median == pytest.approx(512 / 50)
    assert rows["divergence-ram-kvm"].met is False and rows["divergence-overcommit-kvm"].met is True
