"""Records to feed the state machine and the list filters, without a node."""

from __future__ import annotations

from typing import Any

from aenv.orchestrator.states import State
from aenv.orchestrator.store import SandboxRecord


def record(state: State = State.RUNNING, started_at: str = "", **fields: Any) -> SandboxRecord:
    values: dict[str, Any] = dict(
        sandbox_id="i" + "a" * 20, template_id="tmpl1", alias="base", state=state, created_at=started_at,
        started_at=started_at, end_at=started_at, timeout=1, auto_pause=False, auto_resume=False,
        cpu_count=1, memory_mb=512, disk_size_mb=1024, envd_version="0",
    )  # fmt: skip
    return SandboxRecord(**{**values, **fields})
