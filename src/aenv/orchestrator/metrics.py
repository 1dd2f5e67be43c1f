"""Sandbox metrics history: envd's samples as E2B's `SandboxMetric`, kept by the node across pauses.

Each guest samples itself at a fixed interval into a bounded ring in envd's memory
(`aenv.agent.envd.metrics`), so an idle sandbox costs the node nothing until someone asks. The
node adds what the ring cannot keep: before a sandbox pauses, its samples are saved next to its
saved state, so a paused sandbox still answers, and a filesystem-only pause (whose resume boots a
new guest with an empty ring) loses nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..agent.envd.metrics import INTERVAL_SECONDS
from ..clock import rfc3339

KEPT_SAMPLES = 720  # as many as envd keeps: an hour at its 5 s interval
ARCHIVE_FILE = "metrics.json"
CLOCK_MARGIN = 1.0  # seconds the guest's clock may be ahead of the host's (set by each `/init`)
# Seconds taken off envd's `next_in`, for a guest clock that runs a little fast against the host's.
NEXT_SAMPLE_MARGIN = 0.05


@dataclass
class SampleWatch:
    """Whether a sandbox's guest may hold a metrics sample the node has not saved yet.

    envd takes a sample every `INTERVAL_SECONDS` of its guest's running time, and a guest does
    not run while paused. So a pause need not ask the guest for samples until it has run that
    long since its newest one: pausing again soon after a resume, as a parked agent does, then
    costs no request to the guest. envd's answer says how long the guest runs before its next
    sample (`next_in`), which bounds the quiet time exactly, also when the answer held nothing
    new. An envd that does not say (one started before it could) leaves a bound from what the
    node knows: the host's clock (the sample's time is the guest's, which each `/init` sets,
    rounded down; `CLOCK_MARGIN` allows for the guest's clock being ahead) and, for a sample
    taken after the last request, the running time counted since that request; an answer with
    nothing new leaves no quiet time then. The count starts before a resume and ends after a
    pause, so it never falls short of the truth.
    """

    quiet: float = 0.0  # seconds the guest may still run without taking a new sample
    since: float | None = None  # monotonic start of the running time not yet counted
    ran: float | None = None  # seconds run since the last request (None: none made to this guest)

    def running(self, now: float) -> None:
        """The guest runs from `now` at the latest (monotonic); a later call changes nothing."""
        if self.since is None:
            self.since = now

    def stopped(self, now: float) -> None:
        """The guest was stopped (paused) by `now`."""
        self._count(now)
        self.since = None

    def reset(self) -> None:
        """A new guest boots (from the disk alone): its samples start afresh."""
        self.quiet, self.ran = 0.0, None

    def due(self, now: float) -> bool:
        """Whether the guest, running up to `now`, may hold a sample newer than those saved."""
        self._count(now)
        return self.quiet <= 0

    def saved(
        self, newest: int | None, previous: int | None, wall: float, next_in: float | None = None
    ) -> None:
        """The guest was just asked for its samples: `newest` is now the newest saved (`previous`
        before the request), as of `wall` (the host's Unix time); envd's next sample comes after
        `next_in` seconds of its running time, if it said."""
        if next_in is not None:
            self.quiet = next_in - NEXT_SAMPLE_MARGIN
        elif newest is not None and newest != previous:
            since_newest = wall - newest + CLOCK_MARGIN
            if self.ran is not None:  # the new sample is from after the last request
                since_newest = min(since_newest, self.ran)
            self.quiet = INTERVAL_SECONDS - since_newest
        # else nothing new: the next sample may come at any moment, so `quiet` stays spent
        self.ran = 0.0

    def _count(self, now: float) -> None:
        if self.since is not None:
            self.quiet -= now - self.since
            self.ran = None if self.ran is None else self.ran + now - self.since
            self.since = now


def merge(*batches: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Samples of several batches, one per timestamp (the later batch wins), oldest first, bounded."""
    by_time = {sample["ts"]: sample for batch in batches for sample in batch}
    return [by_time[ts] for ts in sorted(by_time)][-KEPT_SAMPLES:]


def between(samples: list[dict[str, Any]], start: int | None, end: int | None) -> list[dict[str, Any]]:
    return [s for s in samples if (start is None or s["ts"] >= start) and (end is None or s["ts"] <= end)]


def sandbox_metric(sample: dict[str, Any], cpu_count: int) -> dict[str, Any]:
    """One envd sample as E2B's `SandboxMetric` (all nine keys are required by the SDK)."""
    moment = datetime.fromtimestamp(sample["ts"], UTC)
    return {
        "timestamp": rfc3339(moment, timespec="seconds"),
        "timestampUnix": sample["ts"],
        "cpuCount": sample.get("cpu_count", cpu_count),
        "cpuUsedPct": sample.get("cpu_used_pct", 0.0),
        "memUsed": sample.get("mem_used", 0),
        "memTotal": sample.get("mem_total", 0),
        "memCache": sample.get("mem_cache", 0),
        "diskUsed": sample.get("disk_used", 0),
        "diskTotal": sample.get("disk_total", 0),
    }


class MetricsArchive:
    """The samples saved from a sandbox's envd at its pauses, in the sandbox's directory."""

    def __init__(self, workdir: Path):
        self.path = workdir / ARCHIVE_FILE

    def load(self) -> list[dict[str, Any]]:
        try:
            samples = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError):  # damaged: the history is a convenience, not worth a failure
            return []
        return [s for s in samples if isinstance(s, dict) and isinstance(s.get("ts"), int)]

    def add(self, samples: list[dict[str, Any]]) -> None:
        kept = merge(self.load(), samples)
        tmp = self.path.with_name(f".{ARCHIVE_FILE}.tmp")
        tmp.write_text(json.dumps(kept))
        os.replace(tmp, self.path)

    def newest(self) -> int | None:
        samples = self.load()
        return samples[-1]["ts"] if samples else None
