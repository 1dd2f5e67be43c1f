"""Guest agent figures: the tools drive's size and the agent's start time, on real cold boots.

The agent's start time is from init's start (PID 1, after the initramfs) to envd listening, both
read off the guest's serial log: init stamps its lines with the uptime, and envd's log stamps are
the guest's wall clock, which counts from boot too until the node's ``/init`` sets it (the
microvm has no RTC). Also reported: a whole cold boot as the host sees it (QEMU spawn to envd
answering ``/health``) and envd's resident memory once it is ready.

    python -m bench.agent [--boots N] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import secrets
import shutil
import tempfile
import time
from pathlib import Path

from aenv.guest.artifacts import ensure_guest_artifacts
from aenv.vmm.launcher import boot_base_guest

from .stats import HEADER, Figure, summarize

INIT_STARTED = re.compile(r"aenv-init \[(\d+\.\d+)\] init started")
ENVD_LISTENING = re.compile(r"1970-01-01 (\d\d):(\d\d):(\d\d),(\d{3}) envd INFO \S+: envd listening")
ENVD_RSS = re.compile(r"^VmRSS:\s+(\d+) kB", re.MULTILINE)
_MIB = 1 << 20


def agent_start_ms(serial: str) -> float:
    """init started → envd listening, in milliseconds, from one boot's serial log."""
    init = INIT_STARTED.search(serial)
    envd = ENVD_LISTENING.search(serial)
    if init is None or envd is None:
        raise RuntimeError("serial log lacks init's start or envd's listening line (or the clock was set)")
    hours, minutes, seconds, millis = (int(g) for g in envd.groups())
    listening = hours * 3600 + minutes * 60 + seconds + millis / 1000
    return (listening - float(init.group(1))) * 1000


async def boot_once(workdir: Path) -> tuple[float, float, float]:
    """One cold boot of the base guest: (agent start ms, boot to ready ms, envd RSS KiB)."""
    artifacts = ensure_guest_artifacts()
    started = time.perf_counter()
    guest = await boot_base_guest(artifacts, workdir, name="agent" + secrets.token_hex(3))
    ready_ms = (time.perf_counter() - started) * 1000
    try:
        # The command's parent is envd; its answer goes to the serial log, the one place we read.
        await guest.envd.run("grep VmRSS /proc/$PPID/status > /dev/console")
        serial = guest.vm.serial_log.read_text(errors="replace")
    finally:
        await guest.destroy()
    rss = ENVD_RSS.search(serial)
    return agent_start_ms(serial), ready_ms, float(rss.group(1)) if rss else float("nan")


def drive_sizes() -> dict[str, float]:
    """The tools drive's image: its apparent size and what it takes on the host's disk, in MiB."""
    image = ensure_guest_artifacts().tools_image
    st = image.stat()
    return {
        "tools_drive_apparent_mib": st.st_size / _MIB,
        "tools_drive_allocated_mib": st.st_blocks * 512 / _MIB,
    }


async def run(boots: int, home: Path) -> list[Figure]:
    starts, readies, rss = [], [], []
    for i in range(boots):
        start, ready, kib = await boot_once(home / f"vm{i}")
        starts.append(start)
        readies.append(ready)
        rss.append(kib)
    return [
        summarize("agent start (init started -> envd listening)", starts),
        summarize("cold boot to envd ready (host, QEMU spawn on)", readies),
        summarize("envd resident memory once ready", rss, unit="KiB"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--boots", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path("bench/results/agent.json"))
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="aenv-bench-agent-"))
    try:
        figures = asyncio.run(run(args.boots, home))
    finally:
        shutil.rmtree(home, ignore_errors=True)
    sizes = drive_sizes()
    print(HEADER)
    for figure in figures:
        print(figure.row() + ("" if figure.unit == "ms" else f" ({figure.unit})"))
    for name, value in sizes.items():
        print(f"{name:<44} {value:>9.1f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"figures": [f.as_dict() for f in figures], **sizes}, indent=2) + "\n")


if __name__ == "__main__":
    main()
