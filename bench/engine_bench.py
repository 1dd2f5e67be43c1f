"""Snapshot-engine latencies on real VMs, without the API: the floor the node server builds on.

Each figure is wall clock from the engine call to the moment the guest's envd has answered
(create, resume, fork) or the call returned (pause, snapshot).

    python -m bench.engine_bench [--rounds N] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import shutil
import tempfile
import time
from pathlib import Path

from aenv.guest.artifacts import ensure_guest_artifacts
from aenv.repository.posix import SnapshotRepository
from aenv.snapshot.engine import GuestInit, SnapshotEngine
from aenv.vmm.accel import accelerator_from_env

from .stats import HEADER, Figure, ms_since, summarize


def _init() -> GuestInit:
    return GuestInit(access_token=secrets.token_hex(16))


async def run(rounds: int, home: Path) -> list[Figure]:
    engine = SnapshotEngine(
        home, SnapshotRepository(home / "repository"), ensure_guest_artifacts(), accelerator_from_env().accel
    )
    template = await engine.build_template("base")
    samples: dict[str, list[float]] = {k: [] for k in ("cold", "warm", "pause", "resume", "snapshot", "fork")}
    try:
        for _ in range(rounds):
            started = time.perf_counter()
            cold = await engine.start(template.id, "c" + secrets.token_hex(5), _init())
            samples["cold"].append(ms_since(started))
            await engine.kill(cold)
        await engine.pool.set_target(template.id, 1)
        for _ in range(rounds):
            await engine.pool.wait_filled(template.id)
            started = time.perf_counter()
            sandbox = await engine.start(template.id, "s" + secrets.token_hex(5), _init())
            samples["warm"].append(ms_since(started))
            # Dirty some guest memory so pause has pages to capture.
            await sandbox.envd.run(
                "python3 -c 'b = bytearray(16 << 20); b[::4096] = b\"x\" * len(b[::4096])'"
            )

            started = time.perf_counter()
            state = await engine.pause(sandbox)
            samples["pause"].append(ms_since(started))
            started = time.perf_counter()
            sandbox = await engine.resume(state, _init())
            samples["resume"].append(ms_since(started))

            started = time.perf_counter()
            snapshot = await engine.snapshot(sandbox)
            samples["snapshot"].append(ms_since(started))
            engine.repository.delete(snapshot.id)
            await engine.kill(sandbox)

        source = await engine.start(template.id, "f" + secrets.token_hex(5), _init())
        started = time.perf_counter()
        children = await engine.fork(source, [("k" + secrets.token_hex(5), _init()) for _ in range(16)])
        samples["fork"].append(ms_since(started))
        for child in [*children, source]:
            await engine.kill(child)
    finally:
        await engine.close()
    return [
        summarize("create from template, cold (spawn+restore+init)", samples["cold"]),
        summarize("create from template, warm pool", samples["warm"], target="<= 20 ms median"),
        summarize("pause (16 MiB dirtied)", samples["pause"], target="<= 15 ms median"),
        summarize("resume", samples["resume"], target="<= 20 ms median"),
        summarize("snapshot of a running sandbox", samples["snapshot"]),
        summarize("fork into 16, all envd-ready", samples["fork"], target="<= 300 ms"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", type=Path, default=Path("bench/results/engine.json"))
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="aenv-bench-"))
    try:
        figures = asyncio.run(run(args.rounds, home))
    finally:
        shutil.rmtree(home, ignore_errors=True)
    print(HEADER)
    for figure in figures:
        print(figure.row())
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps([f.as_dict() for f in figures], indent=2) + "\n")


if __name__ == "__main__":
    main()
