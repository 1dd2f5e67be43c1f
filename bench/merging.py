"""`--memory-merge`: the harness's node merges equal pages across its QEMUs (`AENV_MEMORY_MERGE`).

Merging needs KSM running on the host, a setting the host shares with every other user of
KSM, so the harness turns it on for the run at a fixed scan rate and gives the host back its own
settings after. ksmd's CPU is part of what idle sandboxes cost, so the density figure counts it.
A merge happens once a page was seen unchanged in two scans, so before measuring idle
sandboxes the density figure waits for KSM to settle: two full scans after the last create.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from aenv.vmm.merge import KSM

# 1000 pages every 20 ms: 50,000 pages (195 MiB) a second; ksmd used 0.12 of a core over 24 idle
# sandboxes and 0.19 over 500 on a 2-core TCG host, and a pass over 500 took about 90 s.
SCAN = {"pages_to_scan": "1000", "sleep_millisecs": "20", "run": "1"}
SCANS_TO_SETTLE = 2
SETTLE_TIMEOUT_S = 600.0


def _read(name: str) -> int:
    return int((KSM / name).read_text())


@contextlib.contextmanager
def ksm_scanning() -> Iterator[None]:
    """KSM on at the harness's scan rate for the block; the host's own settings restored after."""
    if os.geteuid() != 0 or not KSM.is_dir():
        raise SystemExit("--memory-merge needs root and a kernel with KSM (/sys/kernel/mm/ksm)")
    saved = {name: (KSM / name).read_text().strip() for name in SCAN}
    try:
        for name, value in SCAN.items():
            (KSM / name).write_text(value)
        yield
    finally:
        for name, value in saved.items():
            (KSM / name).write_text(value)


def ksmd_pid() -> int | None:
    """The pid of ksmd, the kernel thread that merges (its CPU time is in its /proc stat)."""
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == "ksmd":
                return int(entry.name)
    return None


async def settle() -> float:
    """Wait for `SCANS_TO_SETTLE` full KSM scans from now (at most `SETTLE_TIMEOUT_S`); seconds waited."""
    started, first = time.monotonic(), _read("full_scans")
    while _read("full_scans") < first + SCANS_TO_SETTLE and time.monotonic() - started < SETTLE_TIMEOUT_S:
        await asyncio.sleep(1.0)
    return time.monotonic() - started


def merged_mib() -> float:
    """Host RAM KSM saves now, all processes together (its `general_profit`)."""
    return _read("general_profit") / (1 << 20)
