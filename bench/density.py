"""Idle density: how many sandboxes from `base` the host keeps running idle, and what they cost it.

Host RAM used is MemTotal - MemAvailable after the sandboxes idled, minus the same before they
were created (the warm pool is there both times); the sum of RSS and PSS of their QEMU processes
(`/proc/<pid>/smaps`) says how much of it they own (PSS splits the shared memory image among
them), the anonymous memory of each, split by mapping (`PARTS`), what it is spent on, and their
CPU time over the idle period what idling costs the host's cores.
Overcommit is the guest RAM they were configured with over that host RAM. Creating stops early,
without failing the figure, after a few failed creates or when the host's MemAvailable falls
below a reserve; the figure then says how many it reached and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any

from aenv.snapshot.memory import find_mapping

from .context import Context, Sandboxes, bounded
from .merging import ksmd_pid, merged_mib, settle
from .node import BenchError
from .report import Row
from .stats import summarize
from .targets import TARGETS

RESERVE_MIB = 1024
MAX_CREATE_FAILURES = 3  # one failed create may be a hiccup; this many say the host has had enough
CREATE_CONCURRENCY = 4
# A create answered 429 (no room now) or 503 (its guest was starved of CPU) is tried again, as
# a client should; the row's note counts these.
OVERLOAD_RETRIES = 5
OVERLOAD_BACKOFF_S = 2.0
DENSITY_TARGET = int(TARGETS["density"].bound)


def meminfo_mib() -> dict[str, float]:
    values = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        values[name] = int(rest.split()[0]) / 1024
    return values


def host_used_mib() -> float:
    info = meminfo_mib()
    return info["MemTotal"] - info["MemAvailable"]


def cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system) the processes have used so far; processes that are gone count 0."""
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


# Where a sandbox's own host RAM goes, from its QEMU's /proc/<pid>/smaps: anonymous pages of the
# guest RAM mapping (pages the guest wrote since its restore: copies of the shared memory image's),
# of the TCG translation buffer (QEMU's only executable anonymous mapping), of everything else
# anonymous (heap, thread stacks, device buffers), and its page tables. QEMU 10.0 on Linux maps
# the translation buffer as one anonymous RWX mapping of `tb-size` (tcg/region.c,
# `alloc_code_gen_buffer_anon`; split-wx is off unless QEMU is built with TCG debugging), cut by
# one PROT_NONE guard page per region; under KVM there is none. `tcg_code_merged` (not a part):
# the pages of that buffer KSM merged (smaps `KSM:`), counted in `tcg_code` of every QEMU sharing them.
PARTS = ("guest_ram_written", "tcg_code", "qemu_other_anon", "page_tables")


def guest_ram(pid: int) -> tuple[int, int]:
    """Address range of a QEMU's guest RAM: the private mapping of its memory image (`mem-path=` of
    its command line), which the node's reclaimer may have split into several mappings."""
    for argument in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
        for part in argument.decode(errors="replace").split(","):
            if part.startswith("mem-path="):
                return find_mapping(pid, Path(part.removeprefix("mem-path=")))
    raise LookupError(f"QEMU {pid} maps no memory image")


def qemu_memory_mib(pid: int) -> dict[str, float]:
    """RSS, PSS and `PARTS` of a QEMU process in MiB; zeros for a process that is gone."""
    usage = dict.fromkeys(("rss", "pss", *PARTS, "tcg_code_merged"), 0.0)
    part = "qemu_other_anon"
    with contextlib.suppress(OSError):
        try:
            ram_start, ram_end = guest_ram(pid)
        except LookupError:  # no memory image: a plain boot's anonymous RAM counts as the rest
            ram_start = ram_end = 0
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            field, _, rest = line.partition(" ")
            if not field.endswith(":"):  # a mapping's header: range perms offset dev inode [path]
                start, end = (int(a, 16) for a in field.split("-"))
                words = rest.split()
                if ram_start <= start and end <= ram_end:
                    part = "guest_ram_written"
                elif len(words) == 4 and "x" in words[0]:
                    part = "tcg_code"
                else:
                    part = "qemu_other_anon"
            elif field in ("Rss:", "Pss:", "Anonymous:"):
                key = part if field == "Anonymous:" else field[:-1].lower()
                usage[key] += int(rest.split()[0]) / 1024
            elif field == "KSM:" and part == "tcg_code":
                usage["tcg_code_merged"] += int(rest.split()[0]) / 1024
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmPTE:"):
                usage["page_tables"] = int(line.split()[1]) / 1024
    return usage


async def density(ctx: Context) -> list[Row]:
    requested = ctx.plan.density
    local = ctx.node.local
    stop_reason = ""
    failures: list[str] = []
    retried = 0
    before = host_used_mib() if local else None
    async with Sandboxes(ctx.client) as sandboxes:
        gate = asyncio.Semaphore(CREATE_CONCURRENCY)

        async def create() -> None:
            nonlocal retried
            for attempt in range(OVERLOAD_RETRIES + 1):
                try:
                    await sandboxes.create()
                    return
                except BenchError as exc:
                    if exc.status not in (429, 503) or attempt == OVERLOAD_RETRIES:
                        raise
                retried += 1
                await asyncio.sleep(OVERLOAD_BACKOFF_S)

        async def one() -> None:
            nonlocal stop_reason
            async with gate:
                if stop_reason:
                    return
                if local and meminfo_mib()["MemAvailable"] < RESERVE_MIB:
                    stop_reason = f"host MemAvailable fell below the {RESERVE_MIB} MiB reserve"
                    return
                try:
                    await create()
                except Exception as exc:
                    failures.append(str(exc))
                    if len(failures) >= MAX_CREATE_FAILURES:
                        stop_reason = f"{len(failures)} creates failed, the last with: {exc}"

        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(requested)))
        create_s = time.perf_counter() - started
        ids = list(sandboxes.live)
        all_pids = ctx.node.sandbox_pids()
        pids = [all_pids[i] for i in ids if i in all_pids]
        merging = local and ctx.node.memory_merge
        settle_s = await settle() if merging else 0.0
        ksmd = [pid] if merging and (pid := ksmd_pid()) is not None else []
        cpu_before, ksmd_before = cpu_seconds(pids), cpu_seconds(ksmd)
        await asyncio.sleep(ctx.plan.density_idle_s)
        idle_cores = (cpu_seconds(pids) - cpu_before) / ctx.plan.density_idle_s
        ksmd_cores = (cpu_seconds(ksmd) - ksmd_before) / ctx.plan.density_idle_s
        saved_mib = merged_mib() if merging else 0.0

        used = host_used_mib() - before if before is not None else None
        load = os.getloadavg() if local else None
        memory_mib = (await ctx.client.detail(ids[0]))["memoryMB"] if ids else 0
        usage = [qemu_memory_mib(pid) for pid in pids]
        totals = {key: sum(u[key] for u in usage) for key in usage[0]} if usage else {}
        rss, pss = totals.get("rss", 0.0), totals.get("pss", 0.0)
        owned = {part: round(totals[part] / len(usage), 2) for part in PARTS} if usage else {}

        async def alive(sandbox_id: str) -> bool:
            detail = await ctx.client.detail(sandbox_id)
            return detail["state"] == "running" and await ctx.client.envd_healthy(sandbox_id)

        checks = await bounded(8, [lambda i=i: alive(i) for i in ids])
    healthy = sum(1 for c in checks if c is True)
    configured = len(ids) * memory_mib
    details: dict[str, Any] = {
        "requested": requested,
        "created": len(ids),
        "alive": healthy,
        "stop_reason": stop_reason or None,
        "create_failures": failures,
        "create_overload_retries": retried,
        "create_s": round(create_s, 1),
        "idle_s": ctx.plan.density_idle_s,
        "guest_ram_configured_mib": configured,
        "host_ram_used_mib": used,
        "qemu_rss_mib": rss if local else None,
        "qemu_pss_mib": pss if local else None,
        "qemu_owned_mib_per_sandbox": owned if local else None,
        "load_average": load,
        "idle_cpu_cores": idle_cores if local else None,
        "memory_merge": merging,
    }
    if merging:
        details |= {"ksm_settle_s": round(settle_s, 1), "ksmd_cpu_cores": ksmd_cores}
        details["ksm_saved_mib"] = saved_mib
    reached = f"{len(ids)} created in {create_s:.0f} s"
    if retried:
        reached += f", {retried} creates answered 429 or 503 (node full or overloaded) and tried again"
    if stop_reason:
        reached += f" (stopped: {stop_reason})"
    elif failures:
        reached += f" ({len(failures)} creates failed: {failures[-1]})"
    note = (
        f"{reached}; alive = state running and envd /health through the proxy after "
        f"{ctx.plan.density_idle_s:g} s idle"
    )
    if requested < DENSITY_TARGET:
        note += f"; target not judged: this mode starts {requested}, the target is {DENSITY_TARGET}"
    alive_figure = summarize(f"idle density: alive of {requested} requested", [healthy], unit="count")
    rows = [Row("density", alive_figure, evaluate=requested >= DENSITY_TARGET, note=note, details=details)]
    if used is None or not ids or used <= 0:
        return rows
    assert load is not None
    overcommit = summarize("idle density: overcommit (guest RAM / host RAM)", [configured / used], unit="x")
    usage_note = (
        f"{configured} MiB guest RAM on +{used:.0f} MiB host RAM (MemTotal-MemAvailable); each QEMU owns "
        + ", ".join(f"{part.replace('_', ' ')} {mib:.1f}" for part, mib in owned.items())
        + " MiB; QEMU RSS "
        f"{rss:.0f} MiB, PSS {pss:.0f} MiB; idle, their QEMU processes used {idle_cores:.2f} cores "
        f"({100 * idle_cores / len(ids):.2f} % of a core each); load average "
        f"{load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}"
    )
    per_sandbox = summarize("idle density: host RAM per sandbox", [used / len(ids)], unit="MiB")
    cpu_share = 100 * (idle_cores + ksmd_cores) / len(ids)
    cpu = summarize("idle density: CPU per idle sandbox", [cpu_share], unit="%")
    cpu_note = "share of one host core each idle sandbox's QEMU process used"
    if merging:
        usage_note += (
            f"; memory merged (KSM, settled {settle_s:.0f} s after the creates): {saved_mib:.0f} MiB saved"
        )
        cpu_note += f", with ksmd's share ({ksmd_cores:.2f} cores over the idle period) counted"
    else:
        usage_note += "; memory merging off (--memory-merge turns it on)"
    return [
        *rows,
        Row("density-overcommit", overcommit, note=usage_note),
        Row("density-ram", per_sandbox),
        Row("density-cpu", cpu, note=cpu_note),
    ]
