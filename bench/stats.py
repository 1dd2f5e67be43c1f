"""Summaries of latency samples: what every figure of the harness reports."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field


def ms_since(started: float) -> float:
    """Milliseconds since `started`, a `time.perf_counter()` reading."""
    return (time.perf_counter() - started) * 1000


@dataclass(frozen=True)
class Figure:
    name: str
    unit: str
    count: int
    median: float
    p95: float
    p99: float
    min: float
    max: float
    target: str = ""
    samples: tuple[float, ...] = field(default=(), repr=False)  # as measured, in order

    def row(self) -> str:
        return (
            f"{self.name:<44} {self.median:>9.1f} {self.p95:>9.1f} {self.p99:>9.1f} "
            f"{self.min:>9.1f} {self.max:>9.1f} {self.count:>5}  {self.target}"
        )

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


HEADER = f"{'figure (ms)':<44} {'median':>9} {'p95':>9} {'p99':>9} {'min':>9} {'max':>9} {'n':>5}  target"


def percentile(samples: list[float], fraction: float) -> float:
    """Nearest-rank percentile: an actual sample, never an interpolation between two."""
    ordered = sorted(samples)
    rank = math.ceil(fraction * len(ordered) - 1e-9)  # the smallest rank covering `fraction` of them
    return ordered[max(0, min(len(ordered), rank) - 1)]


def summarize(name: str, samples_ms: list[float], *, target: str = "", unit: str = "ms") -> Figure:
    if not samples_ms:
        raise ValueError(f"no samples for {name}")
    return Figure(
        name=name,
        unit=unit,
        count=len(samples_ms),
        median=statistics.median(samples_ms),
        p95=percentile(samples_ms, 0.95),
        p99=percentile(samples_ms, 0.99),
        min=min(samples_ms),
        max=max(samples_ms),
        target=target,
        samples=tuple(samples_ms),
    )
