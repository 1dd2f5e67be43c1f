"""Node state in SQLite: one row per sandbox, so the catalog of sandboxes survives restarts."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .states import State


@dataclass
class SandboxRecord:
    """Everything the API reports about a sandbox and everything needed to bring it back."""

    sandbox_id: str
    template_id: str
    alias: str | None
    state: State
    created_at: str
    started_at: str
    end_at: str
    timeout: int
    auto_pause: bool
    auto_resume: bool
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    envd_version: str
    secure: bool = True
    envd_token: str | None = None
    traffic_token: str | None = None
    allow_internet: bool | None = None
    network: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    paused_at: str | None = None
    auto_pause_memory: bool = True  # false: a timeout's pause keeps only the disk
    volume_mounts: list[dict[str, str]] = field(default_factory=list)  # E2B's [{"name", "path"}]
    # Paused, and the pause is committed to the shared repository: another node can take it over.
    durable: bool = False
    # Counts the changes of the state or of `durable` the node has settled and saved, so that the
    # cluster's scheduler can tell a late report of this sandbox from a newer one (`Binding`).
    generation: int = 0

    def __post_init__(self) -> None:
        self.state = State(self.state)  # rows store the state's plain string


class SandboxStore:
    """A small SQLite table; every write is its own transaction, readers see committed rows."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS sandboxes (id TEXT PRIMARY KEY, state TEXT NOT NULL,"
            " created_at TEXT NOT NULL, body TEXT NOT NULL)"
        )
        path.chmod(0o600)

    def put(self, record: SandboxRecord) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO sandboxes (id, state, created_at, body) VALUES (?, ?, ?, ?)",
            (record.sandbox_id, record.state, record.created_at, json.dumps(asdict(record))),
        )

    def delete(self, sandbox_id: str) -> None:
        self._db.execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        row = self._db.execute("SELECT body FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
        return None if row is None else SandboxRecord(**json.loads(row[0]))

    def all(self) -> list[SandboxRecord]:
        rows = self._db.execute("SELECT body FROM sandboxes ORDER BY created_at DESC, id").fetchall()
        return [SandboxRecord(**json.loads(body)) for (body,) in rows]

    def close(self) -> None:
        self._db.close()
