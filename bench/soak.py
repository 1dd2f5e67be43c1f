"""Soak: many create → exec → pause → resume → kill cycles, and whether anything the node holds grows.

Before the first cycle and after the last (each time once the warm pool is full again) the
harness counts what a leak would leave behind: QEMU processes under the node's home, network
namespaces, the node's open file descriptors, files under its home, nftables rules and VM cgroups.
Every count must come back to where it started: the `soak` row's value is their growth.

The node's RSS is judged apart (`soak-rss`), on the run's second half only, from samples at
`CHECKPOINTS` checkpoints (each once the warm pool is full again). A Python process's RSS rises for
a while after it starts doing something new (pymalloc arenas and the C allocator's heap fill with
freed-but-kept, fragmented blocks; bounded caches such as yarl's URL cache fill up) and then stays
flat, while a leak keeps rising by the same amount every cycle. So the row's value is the RSS at
the end minus the RSS at the checkpoint halfway through; every checkpoint's RSS is in its note, and
where it is (heap, mapped files, shared memory) in its details. (A
tracemalloc diff of the node over 200 cycles found one leak this way, a logger per QEMU process,
since fixed in `aenv.vmm.machine.qmp_client`; the rest of the Python heap stayed flat after the
first 80 cycles.) The cycles' durations (checkpoints excluded) are `soak-cycle`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

from aenv.devnode import netns_names
from aenv.vmm.confine import CgroupTree

from .context import Context, Sandboxes
from .report import Row
from .stats import summarize

COUNTS = ("qemu", "namespaces", "node_fds", "home_files", "nft_rules", "cgroups")
CHECKPOINTS = 10  # RSS samples through the run, after the one before the first cycle
# The node's RSS at each checkpoint and where it is (in the row's details): the heap (a leak grows
# it), pages of mapped files (shared libraries, SQLite's shared memory file) and shared memory.
MEMORY = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def _qemu_processes(home: Path) -> int:
    count = 0
    marker = str(home).encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
                count += cmdline.startswith(b"qemu-system") and marker in cmdline
    return count


def _nft_rules() -> int:
    out = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True, check=False).stdout
    return sum(1 for line in out.splitlines() if line.strip() and not line.strip().endswith(("{", "}")))


def _cgroups() -> int:
    tree = CgroupTree.detect()
    if tree is None:
        return 0
    return sum(len(list((base / "aenv").glob("vm-*"))) for base in tree.bases.values())


def _memory_mib(pid: int) -> dict[str, float]:
    """The `MEMORY` fields of /proc/<pid>/status, in MiB."""
    found = dict.fromkeys(MEMORY, 0.0)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in found:
            found[name] = round(int(value.split()[0]) / 1024, 1)
    return found


def footprint(home: Path, pid: int) -> dict[str, float]:
    """What the node holds now: the counts a leak would grow, and its RSS."""
    return {
        "qemu": _qemu_processes(home),
        "namespaces": len(netns_names()),
        "node_fds": len(os.listdir(f"/proc/{pid}/fd")),
        "home_files": sum(len(files) for _, _, files in os.walk(home)),
        "nft_rules": _nft_rules(),
        "cgroups": _cgroups(),
        "node_rss_mib": _memory_mib(pid)["VmRSS"],
    }


def second_half_growth(rss: dict[int, float]) -> float:
    """RSS growth from the checkpoint halfway through (the last at or before half the cycles) to
    the last one; `rss` is MiB by cycles done, from 0."""
    last = max(rss)
    middle = max(cycle for cycle in rss if cycle * 2 <= last)
    return round(rss[last] - rss[middle], 1)


async def soak(ctx: Context) -> list[Row]:
    node = ctx.node
    if node.home is None or node.pid is None:
        raise RuntimeError("the soak counts what the node holds, which needs a node on this host")
    home, pid = node.home, node.pid
    every = max(1, ctx.plan.soak // CHECKPOINTS)
    await ctx.quiet()
    before = footprint(home, pid)
    memory = {0: _memory_mib(pid)}
    cycles = []
    async with Sandboxes(ctx.client) as sandboxes:
        for done in range(1, ctx.plan.soak + 1):
            started = time.perf_counter()
            sandbox = await sandboxes.create()
            await ctx.client.run(sandbox, "echo soak")
            await ctx.client.pause(sandbox["sandboxID"])
            await ctx.client.resume(sandbox["sandboxID"])
            await sandboxes.kill(sandbox["sandboxID"])
            cycles.append((time.perf_counter() - started) * 1000)
            if done % every == 0 and done < ctx.plan.soak:
                await ctx.quiet()
                memory[done] = _memory_mib(pid)
    await ctx.quiet()
    after = footprint(home, pid)
    memory[len(cycles)] = _memory_mib(pid)
    rss = {done: sample["VmRSS"] for done, sample in memory.items()}
    growth = {name: after[name] - before[name] for name in before}
    grown = sum(max(0, growth[name]) for name in COUNTS)
    late = second_half_growth(rss)
    note = (
        f"{len(cycles)} cycles; growth "
        + ", ".join(f"{name} {growth[name]:+g}" for name in growth)
        + f" (before: {', '.join(f'{name} {before[name]:g}' for name in before)})"
    )
    rss_note = "node RSS (MiB) after N cycles: " + ", ".join(f"{n}: {mib:g}" for n, mib in rss.items())
    return [
        Row(
            "soak",
            summarize("soak: growth of leak counts", [grown], unit="count"),
            note=note,
            details={"before": before, "after": after, "growth": growth},
        ),
        Row(
            "soak-rss",
            summarize("soak: node RSS growth, second half", [late], unit="MiB"),
            note=rss_note,
            details={
                "memory_mib_by_cycles": memory,
                "second_half_growth_mib": late,
            },
        ),
        Row("soak-cycle", summarize("soak: create, exec, pause, resume, kill", cycles)),
    ]
