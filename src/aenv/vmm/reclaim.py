"""Give the host back the guest memory a clone freed: drop its private pages equal to the image.

Why not the balloon or free page reporting: a clone's RAM is a private mapping of the immutable
memory image opened read-only, and QEMU 10.0's `ram_block_discard_range` (what both call)
refuses any block backed by a read-only file ("Discarding RAM with readonly files is not
supported"); with a writable one it would `fallocate(PUNCH_HOLE)` the image every other clone
maps. The kernel has what is wanted: `MADV_DONTNEED` on a private file mapping drops the
copy-on-write page and the address reads the file's page again, from the shared page cache.
Only QEMU may madvise its own memory (`process_madvise` takes no `MADV_DONTNEED` from another
process), so the node makes QEMU's main thread run the call (`_Tracee`, ptrace).

Which pages: those whose private copy equals the image's page byte for byte. Dropping them
changes no byte the guest can read, so pause, resume and fork stay exact. Guests free memory
into that state because they boot with `init_on_free=1` (`aenv.guest.artifacts`): a freed page
is zeroed, and a page free when the template was captured is zero in the image too (the
template boots on a fresh sparse file and zeroes what it frees). Pages the guest dirtied and
then freed that were in use at capture time are zero but differ from the image and stay.

The scan reads the private pages while the guest runs; only the candidates are read again,
compared and dropped with the VM stopped, so no guest write can fall between check and drop.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..snapshot.memory import PAGE_SIZE, dirty_pages, find_mapping, runs
from .machine import MemoryMode, VirtualMachine

_SYS_MADVISE = 28
_MADV_DONTNEED = 4
_PTRACE_GETREGS, _PTRACE_SETREGS = 12, 13
_PTRACE_SINGLESTEP, _PTRACE_DETACH = 9, 17
_PTRACE_SEIZE, _PTRACE_INTERRUPT = 0x4206, 0x4207
_WALL = 0x40000000
_SYSCALL_INSN = b"\x0f\x05"
_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long


class ReclaimError(RuntimeError):
    """QEMU could not be made to drop pages."""


_REGISTERS = (
    "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx", "rdx", "rsi", "rdi",
    "orig_rax", "rip", "cs", "eflags", "rsp", "ss", "fs_base", "gs_base", "ds", "es", "fs", "gs",
)  # fmt: skip


class _Regs(ctypes.Structure):
    """x86-64 `struct user_regs_struct`."""

    _fields_ = [(name, ctypes.c_ulonglong) for name in _REGISTERS]


def _ptrace(request: int, tid: int, addr: int = 0, data: object = None) -> None:
    if _libc.ptrace(request, tid, ctypes.c_void_p(addr), data) == -1:
        errno = ctypes.get_errno()
        raise ReclaimError(f"ptrace {request} on {tid}: {os.strerror(errno)}")


def _wait_stop(tid: int) -> None:
    _, status = os.waitpid(tid, _WALL)
    if not os.WIFSTOPPED(status):
        raise ReclaimError(f"thread {tid} ended while QEMU was made to drop pages ({status:#x})")


def _syscall_address(pid: int, rip: int) -> int:
    """An address holding a `syscall` instruction: just before `rip` when the thread sits in a
    system call (QEMU's main loop waits in ppoll), otherwise the first one in libc's code."""
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        if os.pread(mem.fileno(), 2, rip - 2) == _SYSCALL_INSN:
            return rip - 2
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) == 6 and fields[1].startswith("r-x") and "/libc.so" in fields[5]:
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    found = os.pread(mem.fileno(), end - start, start).find(_SYSCALL_INSN)
                    if found >= 0:
                        return start + found
    raise ReclaimError(f"no syscall instruction found in process {pid}")


def drop(pid: int, runs: list[tuple[int, int]]) -> None:
    """Make process `pid` madvise(MADV_DONTNEED) each (address, length) run of its own memory.

    Its main thread is seized, run through one `syscall` instruction per run with the arguments
    in its registers, and given its registers back; a system call it was interrupted in restarts
    as after a signal. About 0.1 ms per run.
    """
    if not runs:
        return
    _ptrace(_PTRACE_SEIZE, pid)
    try:
        _ptrace(_PTRACE_INTERRUPT, pid)
        _wait_stop(pid)
        saved = _Regs()
        _ptrace(_PTRACE_GETREGS, pid, 0, ctypes.byref(saved))
        insn = _syscall_address(pid, saved.rip)
        try:
            for address, length in runs:
                regs = _Regs.from_buffer_copy(saved)
                regs.rax, regs.orig_rax, regs.rip = _SYS_MADVISE, 2**64 - 1, insn
                regs.rdi, regs.rsi, regs.rdx = address, length, _MADV_DONTNEED
                _ptrace(_PTRACE_SETREGS, pid, 0, ctypes.byref(regs))
                _ptrace(_PTRACE_SINGLESTEP, pid)
                _wait_stop(pid)
                _ptrace(_PTRACE_GETREGS, pid, 0, ctypes.byref(regs))
                if regs.rax != 0:
                    raise ReclaimError(f"madvise in QEMU {pid}: {os.strerror(2**64 - regs.rax)}")
        finally:
            _ptrace(_PTRACE_SETREGS, pid, 0, ctypes.byref(saved))
    finally:
        _ptrace(_PTRACE_DETACH, pid)


def equal_pages(pid: int, start: int, image: Path, indices: np.ndarray) -> np.ndarray:
    """Those of the private page `indices` of the mapping at `start` equal to the image's page."""
    equal: list[np.ndarray] = []
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem, open(image, "rb", buffering=0) as img:
        for first, pages in runs(indices):  # each at most 1 MiB
            size = pages * PAGE_SIZE
            ours = np.frombuffer(os.pread(mem.fileno(), size, start + first * PAGE_SIZE), np.uint64)
            theirs = np.frombuffer(os.pread(img.fileno(), size, first * PAGE_SIZE), np.uint64)
            if ours.size != theirs.size:
                raise ReclaimError(f"{image} is shorter than the guest's RAM")
            same = (ours.reshape(pages, -1) == theirs.reshape(pages, -1)).all(axis=1)
            equal.append(np.flatnonzero(same).astype(np.uint64) + np.uint64(first))
    return np.concatenate(equal) if equal else np.empty(0, np.uint64)


@dataclass(frozen=True)
class Scan:
    """The private pages of a clone's RAM mapped at `start`, and those of them equal to the image
    (candidates)."""

    start: int
    private_pages: int
    candidates: np.ndarray


def scan(pid: int, start: int, end: int, image: Path) -> Scan:
    """Find the droppable pages while the guest runs (they are checked again, stopped, in `settle`)."""
    private = dirty_pages(pid, start, end)
    return Scan(start, int(private.size), equal_pages(pid, start, image, private))


def settle(pid: int, start: int, image: Path, candidates: np.ndarray) -> int:
    """With the guest stopped: drop the candidates still equal to the image; returns pages dropped."""
    still = equal_pages(pid, start, image, candidates)
    drop(pid, [(start + first * PAGE_SIZE, count * PAGE_SIZE) for first, count in runs(still)])
    return int(still.size)


def private_mib(pid: int, start: int, end: int) -> float:
    """MiB of private (written) pages in a clone's RAM mapping."""
    return dirty_pages(pid, start, end).size * PAGE_SIZE / 2**20


@dataclass(frozen=True)
class Reclaimed:
    """One pass over a clone: its private memory before, what went back to the host, the stop."""

    private_mib: float
    returned_mib: float
    stopped_seconds: float
    seconds: float

    @classmethod
    def of(cls, found: Scan, dropped: int, stopped: float, seconds: float) -> Reclaimed:
        mib = PAGE_SIZE / 2**20
        return cls(found.private_pages * mib, dropped * mib, stopped, seconds)


def _image(vm: VirtualMachine) -> Path:
    image = vm.config.memory_path
    if vm.config.memory_mode is not MemoryMode.PRIVATE_IMAGE or image is None:
        raise ReclaimError(f"QEMU {vm.pid} does not map a memory image privately")
    return image


async def find(vm: VirtualMachine) -> Scan:
    """The pages of `vm`'s RAM equal to its memory image now, found while the guest runs: it only
    reads, so no lock is needed (most of a pass's time: 0.11 of its 0.25 s for 228 MiB)."""
    image = _image(vm)
    start, end = find_mapping(vm.pid, image)
    return await asyncio.to_thread(scan, vm.pid, start, end, image)


async def release(vm: VirtualMachine, found: Scan) -> tuple[int, float]:
    """Stop the guest, drop those of `found`'s candidates still equal to the image, let it run
    again; returns the pages dropped and the seconds it was stopped.

    The caller keeps the VM's other operations out (the sandbox's lock): a pause meanwhile would
    find its guest running again. A VM not running (stopped by a pause) is left stopped.
    """
    if not found.candidates.size:
        return 0, 0.0
    running = (await vm.command("query-status"))["running"]
    if running:
        await vm.command("stop")
    halted = time.monotonic()
    try:
        dropped = await asyncio.to_thread(settle, vm.pid, found.start, _image(vm), found.candidates)
    finally:
        if running:
            await vm.command("cont")
    return dropped, time.monotonic() - halted


async def reclaim(vm: VirtualMachine) -> Reclaimed:
    """Return to the host the pages of `vm`'s RAM equal to its memory image (see the module and
    `release` for what the caller must hold)."""
    started = time.monotonic()
    found = await find(vm)
    dropped, stopped = await release(vm, found)
    return Reclaimed.of(found, dropped, stopped, time.monotonic() - started)
