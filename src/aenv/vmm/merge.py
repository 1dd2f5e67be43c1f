"""Memory merging across VMMs (the kernel's KSM): more idle sandboxes per host, less isolation.

Idle clones of one template hold many equal pages the memory image cannot share: pages every
guest wrote alike after its restore, and QEMU's own memory (heap, TLB tables, the relocated
read-only data of its binary and libraries, much of the TCG translation buffer). KSM merges
equal pages of processes that opted in, but only pages equal byte for byte: with address space
layout randomisation every QEMU's pointers, and so those pages, differ. Measured on 24 idle
clones under TCG: 33.2 MiB of host RAM each without KSM, 30.3 with KSM on guest RAM alone
(QEMU's own `mem-merge`), 28.3 with all of QEMU's memory mergeable, and 19.3 with that and a
fixed layout.

So with `memory_merge` on, the node makes its own memory, and so that of every process it
starts, mergeable (`PR_SET_MEMORY_MERGE`, kept across fork and execve), and starts QEMU with
a fixed layout (`ADDR_NO_RANDOMIZE`). The price: ksmd's CPU, a copy on the first write to a
merged page, QEMU without layout randomisation, and the side channels of shared pages between
sandboxes (a guest can tell whether another holds a page it guesses). It suits a fleet whose
sandboxes all belong to one tenant, such as one RL training run; it is off by default.

Merging happens only while KSM runs on the host (`/sys/kernel/mm/ksm/run` is 1). That and its
scan rate are the host's, shared with every other user of KSM, so the node reads them but
leaves them to the operator.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

KSM = Path("/sys/kernel/mm/ksm")
_PR_SET_MEMORY_MERGE = 67
_ADDR_NO_RANDOMIZE = 0x0040000
_QUERY_PERSONALITY = 0xFFFFFFFF
_libc = ctypes.CDLL(None, use_errno=True)
_enabled = False


class MergeError(OSError):
    """This process cannot make its memory mergeable (no KSM in the kernel, or no CAP_SYS_RESOURCE)."""


def ksm_running() -> bool:
    """Whether KSM is merging on this host now."""
    try:
        return (KSM / "run").read_text().strip() == "1"
    except OSError:
        return False


def enable() -> None:
    """Make this process's memory, and that of every process it starts, mergeable; QEMUs started
    from now on get a fixed layout. Logs a warning when KSM does not run on the host.

    Raises MergeError when the kernel refuses.
    """
    global _enabled
    if _libc.prctl(_PR_SET_MEMORY_MERGE, 1, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise MergeError(errno, f"cannot make memory mergeable (PR_SET_MEMORY_MERGE): {os.strerror(errno)}")
    _enabled = True
    if not ksm_running():
        log.warning(
            "memory_merge is on but KSM does not run on this host, so nothing is merged: "
            "echo 1 > %s (and set its scan rate, %s)", KSM / "run", KSM / "pages_to_scan",
        )  # fmt: skip


def enabled() -> bool:
    """Whether this process made its memory, and its VMMs', mergeable (`enable`)."""
    return _enabled


def saved_bytes(pids: Iterable[int]) -> int:
    """Host RAM that merging saves in these processes now: the kernel's `ksm_process_profit`
    (merged pages less KSM's own bookkeeping); a process that is gone counts 0."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{pid}/ksm_stat").read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "ksm_process_profit":
                    total += int(value)
    return total


@contextlib.contextmanager
def fixed_layout() -> Iterator[None]:
    """Processes this thread starts inside get no address space layout randomisation, when
    merging is on (a personality flag, per thread and kept across execve); else nothing changes."""
    if not _enabled:
        yield
        return
    before = _libc.personality(_QUERY_PERSONALITY)
    _libc.personality(before | _ADDR_NO_RANDOMIZE)
    try:
        yield
    finally:
        _libc.personality(before)
