"""Rollout figures (issue 34): the RL workload itself, not its primitives.

A rollout is: create from a prepared snapshot → 8 tool calls (a command, a file write, a file
read, in turn, through the node's proxy as the SDK sends them) → read a reward file → kill.
- `rollout-<N>`: N rollouts at once, `rollout_rounds` after each other; tool-call latencies,
  rollouts per minute. Floor: the tool-call p99 of one rollout alone (`rollout-1`).
- `rollout-fanout`: one fan-out of `rollout_fan_out` sandboxes until every one answered a
  command; floor: as many bare restores at once, each then running a command through its envd.
- `rollout-reset`: reset to a checkpoint; floor: the resume of a parked (paused, process kept)
  sandbox, the cheapest way back to a saved state there was.
- `rollout-reuse`: one rollout that resets its sandbox to a checkpoint instead of creating
  and killing one; floor: the create-and-kill rollout, measured alternately with it.

Under TCG every new QEMU process translates the guest's code afresh, and a reset restores into
one (loading CPU state flushes a process's translations anyway, `aenv.snapshot.checkpoints`).
Measured here (quick, 2 cores, TCG): 1 rollout alone 88/min, tool call p50 26 ms, p99 289 ms
(the first call in a new process); 16 at once 122/min, p99 3.4 s; 64 at once 80/min, p99 23 s,
none failed; fan-out of 100 38.8 s against 35.9 s for as many bare restores each running a
command (1.08x); reset 485 ms against a parked resume's 53 ms (9.2x); a rollout that resets its
sandbox 501 ms against 698 ms for one that creates and kills (0.72x).
Full mode (2 rounds per worker; 2 cores, TCG, the host shared), after the fixes below: 1 alone
91/min, tool call p50 25 ms, p99 279 ms; 16 at once 131/min, p99 3.3 s (12x), node API p99
9 ms; 64 at once 83/min, p99 22 s (80x), API p99 94 ms (max 238 ms); 256 at once (a
connection each) 60/min, all 512 done, p50 8.5 s, p99 82 s (285x), API p99 1.2 s (max 5 s).
Host CPU was 100 % busy in every concurrent run, the node process 4-8 % of it: the rest is
QEMU's, translating (TCG). Fan-out of 100 0.77-0.92x; reset 466-491 ms against a parked
resume's 49-55 ms (8.4-10x); reuse 0.65-0.67x. Before the fixes the API p99 was 145-185 ms
at 16-256 (py-spy: the node's loop 52 % busy, 19 % of it making pool networks, 7 % of that
parsing the host's address dump, which grew with the sandboxes: now cached and filtered,
`aenv.network.egress.denied_host_addresses`; 2 % unlinking killed sandboxes' disks, now in a
thread). At 256 the loop still made every pool network itself (17 % of it at 64).

At 256 (main after issue 35's start gate, the same rounds; py-spy of the node, and its main
thread's run and run-queue times from /proc/<pid>/task/<tid>/schedstat): API p99 67-73 ms
(max 229), 95 rollouts/min, tool call p50 1.5 s, p99 15 s. The loop was 25 % busy; of that,
requests 66 % (14 % reading and parsing the template for creates the start gate then refused
with 429: 60,000 in six minutes, the harness retrying every 0.5 s), pool
networks 11 % and moving QEMU into its cgroups 6 % (both blocking: netlink under the RTNL lock,
a cgroup v1 migration through an RCU grace period). The main thread ran 59 s and waited 36 s
for a CPU: the VMs' parent cgroup weighed as much as the node. After pool networks on a thread
of their own (`aenv.network.builder`), cgroup joins in a thread, the start gate before the
template's lookup and `vmm_cpu_weight` 10 (two runs): API p99 11-19 ms (max 128-151), 118-120
rollouts/min, p50 0.8-1.0 s, p99 13-15 s; the loop 10 % busy, the main thread ran 30-31 s and
waited 7.2-7.6 s. At 64 the API
p99 went 49-50 -> 12-13 ms, at 16 21 -> 2 ms (tool call p50 264 -> 129 ms, 136 -> 155/min).
`vmm_cpu_weight` went back to 100 by default afterwards: on cgroup v1 each busy process outside
the VMs' group then outweighed them all, and the 256-SDK-sandbox test through a gateway starved.
With 100 (quick, `--rollout-counts 256 --rollout-parts concurrent`, one round): API p99
22-24 ms (max 117-142), 101 rollouts/min, tool call p50 1.3 s, p99 13.5 s.

Resets now continue a standby restored ahead of time (`aenv.snapshot.standby`; quick, reset rows
only, `--rollout-parts reset`, 3 runs each): reset 375/396/400 ms against a parked resume's
60/66/69 ms (6.3/6.0/5.8x; the standby made again after that resume runs beside it), before
473/455/478 ms against 53/51/49 ms (8.9/8.9/9.9x); reuse 0.48/0.51/0.51x (before 0.67/0.65/0.68x).
Of a reset, 130-145 ms are the node's answer (`cont` 3-12 ms, envd's `/init` 124-137 ms), the
first command after it 235-257 ms: code a process that has not run translates afresh.

Each concurrent row's note gives the node API's p99 and how the host's CPU split between the
node process and QEMU: the evidence of what bounds it under TCG.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from aenv.agent.envd import ENVD_PORT

from .client import NodeClient
from .context import Context, Sandboxes, bounded, host_busy_ticks
from .node import BenchError
from .probe import Probe
from .report import Row
from .stats import ms_since, percentile, summarize

TOOL_CALLS = 8
# Rollouts of the one alone, per round of the others: its p99 is the floor, and 8 tool calls are
# too few samples for one (the first call in a new QEMU process is the slowest, ~270 ms here).
ALONE_ROUNDS = 4
REWARD = "/tmp/reward.txt"
T = TypeVar("T")
CONNECTIONS = 64  # the harness client's, as `NodeClient` has by default
PROBED = ("/health", "/sandboxes")  # the node API while the rollouts run: its loop, and a listing


def _guest(sandbox: dict[str, Any]) -> dict[str, str]:
    headers = {"E2b-Sandbox-Id": sandbox["sandboxID"], "E2b-Sandbox-Port": str(ENVD_PORT)}
    if sandbox.get("envdAccessToken"):
        headers["X-Access-Token"] = sandbox["envdAccessToken"]
    return headers


async def _write(ctx: Context, sandbox: dict[str, Any], path: str, data: bytes) -> None:
    """envd's `/files` upload (multipart, as the SDK sends it)."""
    form = aiohttp.FormData()
    form.add_field("file", data, filename=path.rsplit("/", 1)[-1])
    status, _, body = await ctx.client.request(
        "POST", f"/files?path={path}&username=root", data=form, headers=_guest(sandbox)
    )
    if status != 200:
        raise BenchError(f"writing {path} answered {status}: {body[:200]!r}")


async def _read(ctx: Context, sandbox: dict[str, Any], path: str) -> bytes:
    status, _, body = await ctx.client.request(
        "GET", f"/files?path={path}&username=root", headers=_guest(sandbox)
    )
    if status != 200:
        raise BenchError(f"reading {path} answered {status}: {body[:200]!r}")
    return body


async def tool_calls(ctx: Context, sandbox: dict[str, Any], latencies: list[float]) -> str:
    """8 tool calls (command, file write, file read in turn), then the reward file's content."""
    for call in range(TOOL_CALLS):
        started = time.perf_counter()
        kind = call % 3
        if kind == 0:
            await ctx.client.run(sandbox, f"echo step {call} >> /tmp/trace")
        elif kind == 1:
            await _write(ctx, sandbox, f"/tmp/out{call}.txt", f"answer {call}\n".encode())
        else:
            await _read(ctx, sandbox, f"/tmp/out{call - 1}.txt")
        latencies.append(ms_since(started))
    return (await _read(ctx, sandbox, REWARD)).decode()


async def _create(ctx: Context, snapshot: str) -> dict[str, Any]:
    """A create from the snapshot; a node that is full (429) or overloaded (503) is asked again a
    moment later, as a harness's creation limiter would (verifiers #1034)."""
    for _ in range(600):
        try:
            return await ctx.client.create(snapshot)
        except BenchError as exc:
            if exc.status not in (429, 503):
                raise
            await asyncio.sleep(0.5)
    raise BenchError("the node stayed full for 5 minutes")


async def rollout(ctx: Context, snapshot: str, latencies: list[float]) -> None:
    sandbox = await _create(ctx, snapshot)
    try:
        if (await tool_calls(ctx, sandbox, latencies)).strip() != "1":
            raise BenchError("the reward file did not hold the prepared reward")
    finally:
        await ctx.client.kill(sandbox["sandboxID"])


async def prepared(ctx: Context, sandboxes: Sandboxes) -> str:
    """A snapshot of a sandbox that holds the task's reward file: what the rollouts start from."""
    source = await sandboxes.create()
    await ctx.client.run(source, f"echo 1 > {REWARD}; sync")
    snapshot = await ctx.client.snapshot(source["sandboxID"])
    await sandboxes.kill(source["sandboxID"])
    return snapshot["snapshotID"]


@dataclass
class CpuSplit:
    """The host's CPU over a run: how busy it was, and the node process's share of that. What is
    not the node's (nor the harness's, small beside it) is QEMU's: under TCG, each new process
    translating the guest's code afresh."""

    busy: float  # of all the host's CPU time
    node: float  # of the busy time

    @classmethod
    async def over(cls, pid: int | None, run: Awaitable[T]) -> tuple[T, CpuSplit | None]:
        busy, total = host_busy_ticks()
        node = _process_ticks(pid)
        result = await run
        busy_now, total_now = host_busy_ticks()
        node_now = _process_ticks(pid)
        if node is None or node_now is None or busy_now == busy:
            return result, None
        return result, cls((busy_now - busy) / (total_now - total), (node_now - node) / (busy_now - busy))

    def note(self) -> str:
        return f"host CPU {self.busy:.0%} busy, {self.node:.0%} of that the node process, the rest QEMU's"


def _process_ticks(pid: int | None) -> int | None:
    """utime + stime of a process, in clock ticks (as /proc/stat counts them)."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])


@dataclass
class Concurrent:
    """What `count` rollouts at once measured."""

    latencies: list[float]  # tool calls, ms
    per_minute: float  # rollouts that succeeded
    failed: int
    api: dict[str, list[float]]  # the node API's latencies (ms) per probed path, throughout
    errors: Counter[str]  # the failed rollouts' errors, by their message's start
    cpu: CpuSplit | None  # where the host's CPU went meanwhile (a node on this host only)

    def failures_note(self) -> str:
        return "; ".join(f"{count}x {message}" for message, count in self.errors.most_common(3))

    def api_note(self) -> str:
        return "; ".join(
            f"API {path} p99 {percentile(samples, 0.99):.0f} ms (max {max(samples):.0f}, n={len(samples)})"
            for path, samples in self.api.items()
            if samples
        )


async def concurrent(ctx: Context, snapshot: str, count: int, rounds: int) -> Concurrent:
    """`count` rollouts at once, each worker running `rounds` of them one after the other, with
    the node API probed every 100 ms meanwhile (`bench.probe`)."""
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    await ctx.host_quiet()
    # A connection each, as `count` harness processes would have: with fewer, creates queue for
    # one and time out (aiohttp's connect timeout covers that wait), which the node never saw.
    client = NodeClient(ctx.node, max_connections=max(CONNECTIONS, count))
    own = dataclasses.replace(ctx, client=client)

    async def worker() -> None:
        for _ in range(rounds):  # a failed rollout is counted, and the worker goes on with the next
            try:
                await rollout(own, snapshot, latencies)
            except Exception as exc:
                errors[f"{type(exc).__name__}: {exc}"[:160]] += 1

    try:
        async with Probe(ctx.node.url, ctx.node.api_key, PROBED) as probe:
            started = time.perf_counter()
            _, cpu = await CpuSplit.over(ctx.node.pid, asyncio.gather(*(worker() for _ in range(count))))
            minutes = (time.perf_counter() - started) / 60
    finally:
        await client.aclose()
    failed = errors.total()
    return Concurrent(latencies, (count * rounds - failed) / minutes, failed, probe.latencies, errors, cpu)


async def concurrent_rows(ctx: Context, snapshot: str) -> list[Row]:
    alone = await concurrent(ctx, snapshot, 1, ALONE_ROUNDS * ctx.plan.rollout_rounds)
    floor = percentile(alone.latencies, 0.99)
    figure = summarize("1 rollout: tool-call latency", alone.latencies)
    rows = [Row("rollout-1", figure, note=f"{alone.per_minute:.0f} rollouts/min; {alone.api_note()}")]
    for count in ctx.plan.rollout_counts:
        run = await concurrent(ctx, snapshot, count, ctx.plan.rollout_rounds)
        note = f"{run.per_minute:.0f} rollouts/min; {run.failed} failed"
        note += (f" ({run.failures_note()})" if run.failed else "") + f"; {run.api_note()}"
        note += f"; {run.cpu.note()}" if run.cpu else ""
        figure = summarize(f"{count} concurrent rollouts: tool-call latency", run.latencies)
        details = {
            "rollouts_per_min": round(run.per_minute, 1),
            "failed": run.failed,
            "api_p99_ms": {path: percentile(samples, 0.99) for path, samples in run.api.items() if samples},
            "api_max_ms": {path: max(samples) for path, samples in run.api.items() if samples},
            "host_cpu_busy": None if run.cpu is None else round(run.cpu.busy, 3),
            "node_share_of_busy": None if run.cpu is None else round(run.cpu.node, 3),
        }
        rows.append(
            Row(f"rollout-{count}", figure, floor, "tool-call p99 of 1 rollout", note=note, details=details)
        )
    return rows


async def fan_out_row(ctx: Context, snapshot: str) -> Row:
    count = ctx.plan.rollout_fan_out
    await ctx.host_quiet()
    started = time.perf_counter()
    made = [
        r["sandbox"] for r in await ctx.client.fan_out(snapshot, count, uuid.uuid4().hex) if "sandbox" in r
    ]
    try:
        ran = await bounded(32, [lambda s=s: ctx.client.run(s, "true") for s in made])
        wall = ms_since(started)
    finally:
        await bounded(8, [lambda s=s: ctx.client.kill(s["sandboxID"], missing_ok=True) for s in made])
    await ctx.host_quiet()
    floor = None if ctx.lab is None else await ctx.lab.restore_and_run_many(count)
    note = (
        f"{len(made)} of {count} started, {sum(not isinstance(r, BaseException) for r in ran)} ran a command"
    )
    if floor is not None:
        note += f"; floor: wall clock of {count} bare restores at once, each then running `true`"
    figure = summarize(f"fan-out of {count} until all ran a command", [wall])
    return Row("rollout-fanout", figure, floor, f"{count} bare restores + a command", note=note)


async def reset_rows(ctx: Context, snapshot: str) -> list[Row]:
    """Reset against a parked resume, and reset-and-reuse rollouts against create-and-kill ones."""
    resets, resumes, reuse, fresh, latencies = [], [], [], [], []
    async with Sandboxes(ctx.client) as sandboxes:
        sandbox = sandboxes.track(await _create(ctx, snapshot))
        sandbox_id = sandbox["sandboxID"]
        await ctx.client.checkpoint(sandbox_id, "start")
        for _ in range(ctx.plan.rollout_resets):
            await ctx.host_quiet()
            started = time.perf_counter()
            await ctx.client.reset(sandbox_id, "start")
            await ctx.client.run(sandbox, "true")
            resets.append(ms_since(started))
            await ctx.client.pause(sandbox_id)
            started = time.perf_counter()
            await ctx.client.resume(sandbox_id)  # parked: the node kept its process (PARK_SECONDS)
            await ctx.client.run(sandbox, "true")
            resumes.append(ms_since(started))
            started = time.perf_counter()
            await tool_calls(ctx, sandbox, latencies)
            await ctx.client.reset(sandbox_id, "start")
            reuse.append(ms_since(started))
            started = time.perf_counter()
            await rollout(ctx, snapshot, latencies)
            fresh.append(ms_since(started))
    note = "each until a command ran after it"
    return [
        Row("rollout-reset", summarize("reset to a checkpoint", resets), statistics.median(resumes),
            "parked resume", note=note),
        Row("rollout-reuse", summarize("rollout reusing its sandbox", reuse), statistics.median(fresh),
            "rollout with create and kill", note="alternating; 8 tool calls and the reward read each"),
    ]  # fmt: skip


async def rollouts(ctx: Context) -> list[Row]:
    async with Sandboxes(ctx.client) as sandboxes:
        snapshot = await prepared(ctx, sandboxes)
    parts = ctx.plan.rollout_parts
    try:
        rows = await concurrent_rows(ctx, snapshot) if "concurrent" in parts else []
        rows += [await fan_out_row(ctx, snapshot)] if "fanout" in parts else []
        rows += await reset_rows(ctx, snapshot) if "reset" in parts else []
    finally:
        await ctx.client.delete_snapshot(snapshot)
    return rows
