"""Result rows: a figure with its target and floor, printed as one table and written as JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .stats import Figure
from .targets import TARGETS, Target


@dataclass
class Row:
    """One line of the table. `floor` is the floor's value, in the figure's unit, of the statistic
    a ratio target compares (the median unless the target names another); `evaluate=False`
    reports the target without judging it (a mode too small for it, e.g. 24 sandboxes of 200)."""

    key: str
    figure: Figure
    floor: float | None = None
    floor_name: str = ""
    evaluate: bool = True
    note: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def target(self) -> Target | None:
        return TARGETS.get(self.key)

    @property
    def ratio(self) -> float | None:
        """The figure over its floor, in the statistic the target compares (the median if none):
        the node's overhead (or, for throughput, its share of direct). `floor` holds the floor's
        value of that same statistic."""
        if self.floor is None or self.floor == 0:
            return None
        target = self.target
        statistic = target.statistic if target is not None and target.ratio else "median"
        return getattr(self.figure, statistic) / self.floor

    @property
    def met(self) -> bool | None:
        """Whether the target (and its cap) holds; None when there is none, it is not judged, or
        its input is missing."""
        target = self.target
        if target is None or not self.evaluate:
            return None
        judged = [self._holds(t) for t in (target, target.cap) if t is not None]
        return None if None in judged else all(judged)

    def _holds(self, target: Target) -> bool | None:
        if target.ratio:
            value = self.ratio
        elif target.statistic == "value":
            value = self.figure.median
        else:
            value = getattr(self.figure, target.statistic)
        return None if value is None else target.holds(value)

    def as_dict(self) -> dict[str, Any]:
        target = self.target
        return {
            "key": self.key,
            **self.figure.as_dict(),
            "target": str(target) if target else None,
            "previous_target": target.previous or None if target else None,
            "floor": self.floor,
            "floor_name": self.floor_name or None,
            "ratio": self.ratio,
            "met": self.met,
            "note": self.note or None,
            "details": self.details,
        }


_COLUMNS = (
    ("figure", 46, "<"),
    ("unit", 5, "<"),
    ("median", 9, ">"),
    ("p95", 9, ">"),
    ("p99", 9, ">"),
    ("min", 9, ">"),
    ("max", 9, ">"),
    ("n", 4, ">"),
    ("floor", 8, ">"),
    ("ratio", 7, ">"),
    ("target", 28, "<"),
    ("met", 4, "<"),
    ("old target", 16, "<"),
)


def _number(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.1f}" if abs(value) < 10_000 else f"{value:.0f}"


def _line(cells: list[str]) -> str:
    return " ".join(f"{cell:{align}{width}}" for cell, (_, width, align) in zip(cells, _COLUMNS, strict=True))


def table(rows: list[Row]) -> str:
    """The figures as a fixed-width table, then the notes the rows carry."""
    lines = [_line([name for name, _, _ in _COLUMNS]), _line(["-" * width for _, width, _ in _COLUMNS])]
    notes = []
    for row in rows:
        f = row.figure
        spread = ["", "", "", ""] if f.count == 1 else [_number(v) for v in (f.p95, f.p99, f.min, f.max)]
        met = {True: "yes", False: "NO", None: "-"}[row.met]
        target = str(row.target) if row.target else ""
        previous = row.target.previous if row.target else ""
        ratio = f"{row.ratio:.2f}x" if row.ratio is not None else ("n/a" if row.floor_name else "")
        floor = _number(row.floor) if row.floor_name else ""
        cells = [
            f.name,
            f.unit,
            _number(f.median),
            *spread,
            str(f.count),
            floor,
            ratio,
            target,
            met,
            previous,
        ]
        lines.append(_line(cells))
        if row.note:
            notes.append(f"  {f.name}: {row.note}")
    if notes:
        lines += ["", "notes:", *notes]
    return "\n".join(lines)


def write_json(path: Path, rows: list[Row], meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {**meta, "figures": [row.as_dict() for row in rows]}
    path.write_text(json.dumps(document, indent=2) + "\n")
