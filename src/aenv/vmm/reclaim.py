"""Give the host back the guest memory a clone freed: drop its private pages equal to the image.

Why not the balloon or free page reporting: a clone's RAM is a private mapping of the immutable
memory image opened read-only, and QEMU 10.0's `ram_block_discard_range` (what both call)
refuses any block backed by a read-only file ("Discarding RAM with readonly files is not
supported"); with a writable one it would `fallocate(PUNCH_HOLE)` the image every other clone
maps. The kernel has what is wanted: `MADV_DONTNEED` on a private file mapping drops the
copy-on-write page and the address reads the file's page again, from the shared page cache.
Only QEMU may madvise its own memory (`process_madvise` takes no `MADV_DONTNEED` from another
process), so the node makes QEMU's main thread run the call (`_syscalls`, ptrace).

Which pages: those whose private copy reads as what the address would read without it: for the
file's mapping, the image's page byte for byte; for a run remapped anonymous (below), zero.
Dropping them changes no byte the guest can read, so pause, resume and fork stay exact. Guests
free memory into that state because they boot with `init_on_free=1` (`aenv.guest.artifacts`): a
freed page is zeroed, and a page free when the template was captured is zero in the image too
(the template boots on a fresh sparse file and zeroes what it frees).

A page that held data at the capture and was freed since is zero but unlike the image: dropping
it would bring the image's bytes back, and with `init_on_free` the guest counts on a free page
reading zero. Such runs are remapped instead: QEMU's main thread maps anonymous memory over them
(`mmap(MAP_FIXED)`), which reads zero and holds nothing until written, as userfaultfd-filled
anonymous RAM would, for the pages that need it only. The guest RAM then spans several mappings
(`aenv.snapshot.memory` captures a remapped run as zero pages); `MAX_MAPPINGS` bounds how many.
Measured on a guest that dropped its clean page cache after the divergence workload: 3,723 such
pages in 478 runs, 14.5 MiB, which the drop alone would have kept.

The scan reads the private pages while the guest runs; only the candidates are read again,
compared and dropped or remapped with the VM stopped, so no guest write can fall between check
and drop.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..snapshot.memory import (
    PAGE_SIZE,
    anonymous_pages,
    dirty_pages,
    find_mapping,
    ram_mappings,
    remapped_pages,
    runs,
)
from .machine import MemoryMode, VirtualMachine

_SYS_MMAP, _SYS_MADVISE = 9, 28
_MADV_DONTNEED = 4
_PROT_READ_WRITE = 0x3
_MAP_PRIVATE_ANONYMOUS_FIXED = 0x02 | 0x20 | 0x10
# Mappings the guest RAM may be split into: each remapped run adds up to two to QEMU's, whose
# limit is the host's vm.max_map_count (65,530 by default); a pass remaps its longest runs first.
MAX_MAPPINGS = 4096
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


def _syscalls(pid: int, calls: list[tuple[int, tuple[int, ...], int]]) -> None:
    """Make process `pid` run each (number, arguments, expected result) system call itself.

    Its main thread is seized, run through one `syscall` instruction per call with the arguments
    in its registers, and given its registers back; a system call it was interrupted in restarts
    as after a signal. About 0.1 ms per call.
    """
    if not calls:
        return
    _ptrace(_PTRACE_SEIZE, pid)
    try:
        _ptrace(_PTRACE_INTERRUPT, pid)
        _wait_stop(pid)
        saved = _Regs()
        _ptrace(_PTRACE_GETREGS, pid, 0, ctypes.byref(saved))
        insn = _syscall_address(pid, saved.rip)
        try:
            for number, arguments, expected in calls:
                regs = _Regs.from_buffer_copy(saved)
                regs.rax, regs.orig_rax, regs.rip = number, 2**64 - 1, insn
                for name, value in zip(("rdi", "rsi", "rdx", "r10", "r8", "r9"), arguments, strict=False):
                    setattr(regs, name, value % 2**64)
                _ptrace(_PTRACE_SETREGS, pid, 0, ctypes.byref(regs))
                _ptrace(_PTRACE_SINGLESTEP, pid)
                _wait_stop(pid)
                _ptrace(_PTRACE_GETREGS, pid, 0, ctypes.byref(regs))
                if regs.rax != expected:
                    error = os.strerror(2**64 - regs.rax) if regs.rax > 2**64 - 4096 else hex(regs.rax)
                    raise ReclaimError(f"system call {number} in QEMU {pid}: {error}")
        finally:
            _ptrace(_PTRACE_SETREGS, pid, 0, ctypes.byref(saved))
    finally:
        _ptrace(_PTRACE_DETACH, pid)


def drop(pid: int, runs: list[tuple[int, int]]) -> None:
    """Make process `pid` madvise(MADV_DONTNEED) each (address, length) run of its own memory."""
    _syscalls(pid, [(_SYS_MADVISE, (address, length, _MADV_DONTNEED), 0) for address, length in runs])


def zero(pid: int, runs: list[tuple[int, int]]) -> None:
    """Make process `pid` map fresh anonymous memory over each (address, length) run of its own."""
    flags, fd = _MAP_PRIVATE_ANONYMOUS_FIXED, -1
    _syscalls(pid, [(_SYS_MMAP, (address, length, _PROT_READ_WRITE, flags, fd, 0), address)
                    for address, length in runs])  # fmt: skip


def classify(
    pid: int, start: int, image: Path, indices: np.ndarray, remapped: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Of the private page `indices` of the guest RAM at `start`: those reading as they would
    without their copy (the image's page, or zero in a `remapped` run), and the zero ones outside
    the remapped runs that differ from the image (to remap; never the first page, so the image
    stays mapped where `find_mapping` looks)."""
    droppable: list[np.ndarray] = []
    zeroed: list[np.ndarray] = []
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem, open(image, "rb", buffering=0) as img:
        for first, pages in runs(indices):  # each at most 1 MiB
            size = pages * PAGE_SIZE
            ours = np.frombuffer(os.pread(mem.fileno(), size, start + first * PAGE_SIZE), np.uint64)
            theirs = np.frombuffer(os.pread(img.fileno(), size, first * PAGE_SIZE), np.uint64)
            if ours.size != theirs.size:
                raise ReclaimError(f"{image} is shorter than the guest's RAM")
            ours = ours.reshape(pages, -1)
            same = (ours == theirs.reshape(pages, -1)).all(axis=1)
            empty = ~ours.any(axis=1)
            page = np.arange(first, first + pages, dtype=np.uint64)
            anonymous = np.isin(page, remapped)
            droppable.append(page[np.where(anonymous, empty, same)])
            zeroed.append(page[empty & ~same & ~anonymous & (page != 0)])  # the first stays mapped
    if not droppable:
        return np.empty(0, np.uint64), np.empty(0, np.uint64)
    return np.concatenate(droppable), np.concatenate(zeroed)


@dataclass(frozen=True)
class Scan:
    """The private pages of a clone's RAM mapped at `start`, those of them that can be dropped,
    and the zeroed ones to remap."""

    start: int
    end: int
    private_pages: int
    droppable: np.ndarray
    zeroed: np.ndarray

    @property
    def candidates(self) -> int:
        return int(self.droppable.size + self.zeroed.size)


def scan(pid: int, start: int, end: int, image: Path) -> Scan:
    """Find what can go back while the guest runs (it is checked again, stopped, in `settle`)."""
    private = dirty_pages(pid, start, end)
    found = classify(pid, start, image, private, remapped_pages(pid, start, end))
    return Scan(start, end, int(private.size), *found)


def _longest(indices: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """The longest runs of `indices`, as many as `budget` allows (each costs two mappings)."""
    found = sorted(runs(indices), key=lambda run: -run[1])
    return found[: max(budget // 2, 0)]


def settle(pid: int, found: Scan, image: Path) -> int:
    """With the guest stopped: drop the droppable pages still so and remap the zeroed ones still
    zero; returns the pages given back."""
    mappings = ram_mappings(pid, found.start, found.end)
    candidates = np.union1d(found.droppable, found.zeroed)
    droppable, zeroed = classify(pid, found.start, image, candidates, anonymous_pages(mappings))
    chosen = _longest(zeroed, MAX_MAPPINGS - len(mappings))
    drop(pid, [(found.start + first * PAGE_SIZE, count * PAGE_SIZE) for first, count in runs(droppable)])
    zero(pid, [(found.start + first * PAGE_SIZE, count * PAGE_SIZE) for first, count in chosen])
    return int(droppable.size) + sum(count for _, count in chosen)


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
    """The pages of `vm`'s RAM that can go back to the host now, found while the guest runs: it only
    reads, so no lock is needed (most of a pass's time: 0.11 of its 0.25 s for 228 MiB)."""
    image = _image(vm)
    start, end = find_mapping(vm.pid, image)
    return await asyncio.to_thread(scan, vm.pid, start, end, image)


async def release(vm: VirtualMachine, found: Scan) -> tuple[int, float]:
    """Stop the guest, give back those of `found`'s candidates that still can go (`settle`), let it
    run again; returns the pages given back and the seconds it was stopped.

    The caller keeps the VM's other operations out (the sandbox's lock): a pause meanwhile would
    find its guest running again. A VM not running (stopped by a pause) is left stopped.
    """
    if not found.candidates:
        return 0, 0.0
    running = (await vm.command("query-status"))["running"]
    if running:
        await vm.command("stop")
    halted = time.monotonic()
    try:
        dropped = await asyncio.to_thread(settle, vm.pid, found, _image(vm))
    finally:
        if running:
            await vm.command("cont")
    return dropped, time.monotonic() - halted


async def reclaim(vm: VirtualMachine) -> Reclaimed:
    """Return to the host the pages of `vm`'s RAM it freed (see the module and `release` for what
    the caller must hold)."""
    started = time.monotonic()
    found = await find(vm)
    dropped, stopped = await release(vm, found)
    return Reclaimed.of(found, dropped, stopped, time.monotonic() - started)
