"""Control-plane figures: create, pause, resume, snapshot, fork, concurrent resumes.

Each sample is wall clock from the client's request to the node's response. The node answers
create, resume (connect), and fork only after every guest's envd has answered its `/init`, so
that response is the moment the sandbox is usable; pause and snapshot answer once the node has
saved what it needs (a node may keep a paused sandbox's stopped QEMU process and write its
device state and pages afterwards: the pause figure says whether it did). Guests are prepared
through the node's proxy.
"""

from __future__ import annotations

import asyncio
import shlex
import statistics
import time
from typing import Any

from .context import SETTLE, Context, Sandboxes, bounded
from .density import cpu_seconds
from .node import BenchError
from .report import Row
from .stats import ms_since, summarize

MARKER = "/tmp/bench-dirtied"
RELEASE_GRACE = 60.0  # seconds past its parking time a busy node may take to end a parked process


def dirty_command(mib: int) -> str:
    """Change `mib` MiB of guest memory and keep it: a background process writes one byte per page
    of a buffer it then holds, so the pages stay in use whatever the guest's memory management
    does; the command returns once they are written."""
    program = (
        f"import signal; b = bytearray({mib} << 20); b[::4096] = b'x' * (len(b) // 4096); "
        f"open({MARKER!r}, 'w').close(); signal.pause()"
    )
    return (
        f"rm -f {MARKER}; setsid python3 -c {shlex.quote(program)} </dev/null >/dev/null 2>&1 & "
        f"for i in $(seq 1200); do test -e {MARKER} && exit 0; sleep 0.05; done; exit 1"
    )


def write_command(path: str, mib: int) -> str:
    """Write `mib` MiB of non-zero data (one random 1 MiB block, repeated) to `path`, then fsync."""
    program = (
        f"import os\nblock = os.urandom(1 << 20)\nwith open({path!r}, 'wb') as f:\n"
        f"    for _ in range({mib}):\n        f.write(block)\n    f.flush()\n    os.fsync(f.fileno())\n"
    )
    return f"rm -f {path}; python3 -c {shlex.quote(program)}"


def _mib(size: int | None) -> float | None:
    return None if size is None else round(size / (1 << 20), 1)


async def create(ctx: Context) -> list[Row]:
    """Create from the warm pool until the node answers, and until a command then ran in the
    sandbox: what a user can do next."""
    samples, usable = [], []
    note = ""
    async with Sandboxes(ctx.client) as sandboxes:
        for _ in range(ctx.plan.create):
            note = await ctx.quiet()
            started = time.perf_counter()
            sandbox = await sandboxes.create()
            samples.append(ms_since(started))
            await ctx.client.run(sandbox, "true")
            usable.append(ms_since(started))
            await sandboxes.kill(sandbox["sandboxID"])
    floor = await ctx.restore_floor()
    if floor is not None:
        note += "; the warm pool restores ahead of time, so a create can beat the bare restore (ratio < 1)"
    figure = summarize("create (POST /sandboxes, warm pool)", samples)
    usable_figure = summarize("create, then `true` ran", usable)
    usable_note = "from the create request until a command run through the proxy had ended"
    return [
        Row("create", figure, floor, "bare restore", note=note),
        Row("create-usable", usable_figure, floor, "bare restore", note=usable_note),
    ]


async def pause_resume(ctx: Context) -> list[Row]:
    """Pause then resume one sandbox whose guest holds `dirty_mib` MiB of changed memory, in rounds."""
    plan = ctx.plan
    pauses, resumes, deltas, kept = [], [], [], []
    async with Sandboxes(ctx.client) as sandboxes:
        sandbox = await sandboxes.create()
        sandbox_id = sandbox["sandboxID"]
        await ctx.client.run(sandbox, dirty_command(plan.dirty_mib))
        for _ in range(plan.pause_resume):
            await asyncio.sleep(SETTLE)
            started = time.perf_counter()
            await ctx.client.pause(sandbox_id)
            pauses.append(ms_since(started))
            kept.append(ctx.node.process_kept(sandbox_id))
            await asyncio.sleep(SETTLE)  # a node that keeps the process writes the delta meanwhile
            if (size := ctx.node.pause_delta_bytes(sandbox_id)) is not None:
                deltas.append(size)
            started = time.perf_counter()
            await ctx.client.resume(sandbox_id)
            resumes.append(ms_since(started))
    captured = (
        f", each pause captured a median {_mib(int(statistics.median(deltas)))} MiB delta" if deltas else ""
    )
    note = (
        f"one sandbox, {plan.pause_resume} rounds; its guest changed {plan.dirty_mib} MiB and keeps it "
        f"(a background process holds the buffer){captured}"
    )
    if ctx.node.local:
        parked = sum(k is True for k in kept)
        note += f"; the node kept the stopped QEMU process after {parked} of {len(kept)} pauses"
    restore, save = await ctx.restore_floor(), await ctx.save_floor()
    details = {"delta_bytes": deltas, "process_kept": kept}
    return [
        Row("pause", summarize(f"pause ({plan.dirty_mib} MiB changed)", pauses), save, "bare stop+save",
            note=note, details=details),
        Row("resume", summarize(f"resume (connect, {plan.dirty_mib} MiB changed)", resumes), restore,
            "bare restore"),
    ]  # fmt: skip


async def released(ctx: Context, sandbox_id: str) -> float:
    """Once a paused sandbox's parked QEMU process is gone (the node ends it after its parking
    time), the seconds that took; a resume then restores the sandbox from its files."""
    node = ctx.node
    if node.process_kept(sandbox_id) is None or node.park_seconds is None:
        raise BenchError("whether the node released a parked process is only visible on this host")
    started = time.monotonic()
    while node.process_kept(sandbox_id):
        if time.monotonic() - started > node.park_seconds + RELEASE_GRACE:
            raise BenchError(f"the node kept {sandbox_id}'s process past {node.park_seconds:g} s")
        await asyncio.sleep(0.1)
    return time.monotonic() - started


async def resume_released(ctx: Context) -> list[Row]:
    """Resume of a paused sandbox after the node let its parked process go: a new QEMU process on
    the sandbox's saved memory, as after any release (age, count, host memory) or a node restart."""
    plan = ctx.plan
    resumes, waits = [], []
    async with Sandboxes(ctx.client) as sandboxes:
        sandbox = await sandboxes.create()
        sandbox_id = sandbox["sandboxID"]
        await ctx.client.run(sandbox, dirty_command(plan.dirty_mib))
        for _ in range(plan.released):
            await ctx.client.pause(sandbox_id)
            waits.append(round(await released(ctx, sandbox_id), 1))
            await asyncio.sleep(SETTLE)
            started = time.perf_counter()
            await ctx.client.resume(sandbox_id)
            resumes.append(ms_since(started))
    note = (
        f"one sandbox, {plan.released} rounds of pause, the node ending its parked process "
        f"(after {waits} s), resume; its guest changed {plan.dirty_mib} MiB and keeps it"
    )
    figure = summarize(f"resume after release ({plan.dirty_mib} MiB changed)", resumes)
    return [Row("resume-released", figure, await ctx.restore_floor(), "bare restore", note=note)]


async def _timed_snapshot(ctx: Context, sandbox: dict[str, Any]) -> tuple[float, float, int | None]:
    """One snapshot of the sandbox, deleted again: its answer time and the time until it was
    durable (ms; it is committed in the background), and its memory delta size."""
    started = time.perf_counter()
    snap = await ctx.client.snapshot(sandbox["sandboxID"])
    elapsed = ms_since(started)
    while not snap.get("durable", True):
        await asyncio.sleep(0.02)
        snap = await ctx.client.snapshot_info(snap["snapshotID"])
    durable = ms_since(started)
    size = ctx.node.snapshot_delta_bytes(snap["snapshotID"])
    await ctx.client.delete_snapshot(snap["snapshotID"])
    return elapsed, durable, size


async def snapshot(ctx: Context) -> list[Row]:
    """Snapshots after the guest wrote a large file, over snapshots of the same sandbox before it
    wrote anything (the floor: what a snapshot costs the node when there is little to capture)."""
    plan = ctx.plan
    samples, durable, deltas, unwritten = [], [], [], []
    write_s = []
    async with Sandboxes(ctx.client) as sandboxes:
        sandbox = await sandboxes.create()
        for _ in range(plan.snapshot):
            await asyncio.sleep(SETTLE)
            unwritten.append((await _timed_snapshot(ctx, sandbox))[0])
        for i in range(plan.snapshot):
            started = time.perf_counter()
            await ctx.client.run(sandbox, write_command(f"/root/bench-{i}.bin", plan.snapshot_write_mib))
            write_s.append(round(time.perf_counter() - started, 1))
            await asyncio.sleep(SETTLE)
            elapsed, durable_ms, size = await _timed_snapshot(ctx, sandbox)
            samples.append(elapsed)
            durable.append(durable_ms)
            if size is not None:
                deltas.append(size)
            await ctx.client.run(sandbox, f"rm -f /root/bench-{i}.bin")
    written = f"{plan.snapshot_write_mib} MiB" if plan.snapshot_write_mib < 1024 else "1 GiB"
    note = f"before each snapshot the guest wrote {written} to a new file with fsync (took {write_s} s)"
    if deltas:
        sizes = [_mib(d) for d in deltas]
        note += f"; memory delta per snapshot {sizes} MiB (mostly the guest's page cache of the file)"
    note += f"; floor: median of {len(unwritten)} snapshots of the same sandbox before it wrote anything"
    details: dict[str, Any] = {"delta_bytes": deltas, "durable_ms": durable, "unwritten_ms": unwritten}
    if (save := await ctx.save_floor()) is not None:
        details["bare_save_ms"] = save
        note += f" (bare stop+save: {save:.1f} ms)"
    figure = summarize(f"snapshot after writing {written}", samples)
    floor = statistics.median(unwritten)
    return [Row("snapshot", figure, floor, "nothing written", note=note, details=details)]


async def fork(ctx: Context) -> list[Row]:
    """Fork into `fork_count` until the node answers (every child's envd took its `/init`), and
    until a command then ran in every child: what a user can do next.

    Each sample starts on a quiet host (the warm pool full, the previous sample's teardown done),
    and says how much CPU each child's QEMU process used by then: under TCG that is mostly the
    guest's code translated afresh in every new process, the cost that bounds this figure."""
    count = ctx.plan.fork_count
    samples, usable, waits = [], [], []
    ready_cpu: list[float] = []
    usable_cpu: list[float] = []
    async with Sandboxes(ctx.client) as sandboxes:
        source = await sandboxes.create()
        for _ in range(ctx.plan.fork):
            await ctx.quiet()
            waits.append(await ctx.host_quiet())
            started = time.perf_counter()
            children = await ctx.client.fork(source["sandboxID"], count)
            samples.append(ms_since(started))
            for child in children:
                sandboxes.track(child)
            pids = [p for i, p in ctx.node.sandbox_pids().items() if i in {c["sandboxID"] for c in children}]
            ready_cpu += [cpu_seconds([pid]) for pid in pids]
            await asyncio.gather(*(ctx.client.run(child, "true") for child in children))
            usable.append(ms_since(started))
            usable_cpu += [cpu_seconds([pid]) for pid in pids]
            for child in children:
                await sandboxes.kill(child["sandboxID"])
    await ctx.host_quiet()
    floor = await ctx.concurrent_restores(count)
    wall = floor[1] if floor else None
    note = f"floor: wall clock of {count} bare restores at once" if floor else ""
    note += f"; before each sample the host was quiet (waited {waits} s)"
    usable_note = "from the fork request until a command run through the proxy had ended in every child"
    details: dict[str, Any] = {"quiet_wait_s": waits}
    if ready_cpu:
        ready_ms, usable_ms = (round(1000 * statistics.median(c)) for c in (ready_cpu, usable_cpu))
        details |= {"child_qemu_cpu_ms_ready": ready_ms, "child_qemu_cpu_ms_usable": usable_ms}
        note += f"; each child's QEMU used a median {ready_ms} ms of CPU until envd-ready"
        usable_note += f"; each child's QEMU used a median {usable_ms} ms of CPU by then"
    name = f"{count} bare restores"
    return [
        Row("fork", summarize(f"fork into {count}, all envd-ready", samples), wall, name, note=note,
            details=details),
        Row("fork-usable", summarize(f"fork into {count}, then `true` ran in each", usable), wall, name,
            note=usable_note),
    ]  # fmt: skip


async def concurrent_resume(ctx: Context) -> list[Row]:
    count = ctx.plan.concurrent
    async with Sandboxes(ctx.client) as sandboxes:
        created = await bounded(4, [sandboxes.create] * count)
        failures = [r for r in created if isinstance(r, BaseException)]
        if failures:
            raise failures[0]
        ids: list[str] = [s["sandboxID"] for s in created if isinstance(s, dict)]
        for result in await bounded(4, [lambda i=i: ctx.client.pause(i) for i in ids]):
            if isinstance(result, BaseException):
                raise result
        kept = [ctx.node.process_kept(i) for i in ids]
        await asyncio.sleep(SETTLE)

        async def timed_resume(sandbox_id: str) -> float:
            started = time.perf_counter()
            await ctx.client.resume(sandbox_id)
            return ms_since(started)

        started = time.perf_counter()
        results = await asyncio.gather(*(timed_resume(i) for i in ids), return_exceptions=True)
        wall = ms_since(started)
    samples = [r for r in results if isinstance(r, float)]
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors and not samples:
        raise errors[0]
    floor = await ctx.concurrent_restores(count)
    details: dict[str, Any] = {"wall_ms": wall, "failed": len(errors)}
    note = f"all {count} requests sent at once; last answered after {wall:.0f} ms"
    if ctx.node.local:
        note += f"; {sum(k is True for k in kept)} of {count} paused sandboxes had kept their QEMU process"
    if errors:
        note += f"; {len(errors)} failed: {errors[0]}"
    if floor:
        details |= {"floor_wall_ms": floor[1], "floor_p99_ms": summarize("", floor[0]).p99}
        details["floor_median_ms"] = median = statistics.median(floor[0])
        note += f"; floor: p99 of {count} bare restores at once (their median {median:.0f} ms)"
    floor_p99 = details.get("floor_p99_ms")
    figure = summarize(f"{count} concurrent resumes (per request)", samples)
    return [
        Row("concurrent-resume", figure, floor_p99, f"p99, {count} bare restores", note=note, details=details)
    ]
