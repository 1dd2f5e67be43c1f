"""Tables for people, JSON for programs: `--output` decides, else whether stdout is a terminal."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, TextIO

Column = tuple[str, Callable[[dict[str, Any]], Any]]


def json_mode(output: str | None) -> bool:
    if output is not None:
        return output == "json"
    return not sys.stdout.isatty()


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=False))


def when(value: str | None) -> str:
    """An RFC 3339 time as local `YYYY-MM-DD HH:MM:SS`."""
    if not value:
        return "-"
    try:
        stamp = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return value
    return stamp.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def cell(value: Any) -> str:
    if value is None or value == "" or value == [] or value == {}:
        return "-"
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[Column], empty: str) -> None:
    if not rows:
        print(empty, file=sys.stderr)
        return
    cells = [[cell(get(row)) for _, get in columns] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, (h, _) in enumerate(columns)]
    for line in [[h for h, _ in columns], *cells]:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())


def emit(value: Any, output: str | None, columns: Sequence[Column], empty: str = "Nothing to show.") -> None:
    """A list (or one object) as JSON or as a table."""
    if json_mode(output):
        print_json(value)
    else:
        table(value if isinstance(value, list) else [value], columns, empty)


def details(value: dict[str, Any], output: str | None) -> None:
    """One object: JSON, or `key: value` lines."""
    if json_mode(output):
        print_json(value)
        return
    width = max((len(k) for k in value), default=0)
    for key, item in value.items():
        text = json.dumps(item) if isinstance(item, list | dict) and item else cell(item)
        print(f"{key.ljust(width)}  {text}")


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class Progress:
    """A one-line byte progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, label: str, total: int, stream: TextIO = sys.stderr) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.stream = stream
        self.enabled = stream.isatty()
        self.started = time.monotonic()
        self._drawn = 0.0

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._drawn > 0.1 or self.done >= self.total):
            self._drawn = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        fraction = min(1.0, self.done / self.total) if self.total else 1.0
        bar = "#" * int(fraction * 30)
        rate = self.done / max(now - self.started, 1e-3)
        text = f"\r{self.label[:40]:<40} [{bar:<30}] {fraction:4.0%} {size(self.done)}/{size(self.total)}"
        self.stream.write(f"{text} {size(rate)}/s\x1b[K")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()


def done(value: Any, message: str, output: str | None) -> None:
    """The result of an action: the object as JSON for programs, a sentence for people."""
    if json_mode(output):
        print_json(value)
    else:
        print(message)
