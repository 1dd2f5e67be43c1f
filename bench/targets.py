"""The node's performance targets, in one table: which statistic of which figure must stay within what."""

from __future__ import annotations

import operator
from dataclasses import dataclass

# Figure keys in the order the harness measures and reports them; `--only` takes these.
FIGURES = (
    "create",
    "pause",
    "resume",
    "snapshot",
    "fork",
    "concurrent-resume",
    "proxy-rtt",
    "proxy-throughput",
    "density",
    "soak",
    "template-build",
)


@dataclass(frozen=True)
class Target:
    """`statistic op bound`: a summary statistic (`median`, `p99`, …), `ratio` to the floor, or `value`."""

    statistic: str
    op: str  # "<=" or ">="
    bound: float
    unit: str = ""

    def holds(self, value: float) -> bool:
        return {"<=": operator.le, ">=": operator.ge}[self.op](value, self.bound)

    def __str__(self) -> str:
        bound = f"{self.bound:g}"
        unit = self.unit if self.unit in ("", "x", "%") else f" {self.unit}"
        name = "" if self.statistic == "value" else f"{self.statistic} "
        return f"{name}{self.op} {bound}{unit}"


TARGETS: dict[str, Target] = {
    "create": Target("median", "<=", 20, "ms"),
    "pause": Target("median", "<=", 15, "ms"),
    "resume": Target("median", "<=", 20, "ms"),
    "snapshot": Target("median", "<=", 50, "ms"),
    "fork": Target("median", "<=", 300, "ms"),
    "concurrent-resume": Target("p99", "<=", 250, "ms"),
    "proxy-rtt": Target("ratio", "<=", 1.5, "x"),
    "proxy-throughput": Target("ratio", ">=", 0.8, "x"),
    "density": Target("value", ">=", 200, "sandboxes"),
    "density-overcommit": Target("value", ">=", 12, "x"),
    "soak": Target("value", "<=", 0, "count"),
    # three small steps cost less than two builds without steps; a rebuild whose steps are all
    # cached costs what a build without steps costs
    "template-build": Target("ratio", "<=", 3, "x"),
    "template-build-cached": Target("ratio", "<=", 1.5, "x"),
}
