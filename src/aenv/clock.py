"""Wall-clock times as the wire and the manifests spell them: RFC 3339 in UTC with a `Z`."""

from __future__ import annotations

from datetime import UTC, datetime


def now() -> datetime:
    return datetime.now(UTC)


def rfc3339(moment: datetime | None = None, *, timespec: str = "milliseconds") -> str:
    """`moment` (default: now) as e.g. ``2025-01-31T12:00:00.123Z``."""
    return (moment or now()).isoformat(timespec=timespec).replace("+00:00", "Z")
