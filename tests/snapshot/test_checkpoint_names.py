"""Which checkpoint names a sandbox takes (`Checkpoints._check_name`), and what a take-over says of
the checkpoints it left behind, without a VM."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from aenv.snapshot.checkpoints import (
    MAX_CHECKPOINTS,
    RECORD,
    Checkpoint,
    CheckpointConflict,
    CheckpointNotFound,
    Checkpoints,
    InvalidCheckpoint,
    _new_id,
)


def checkpoint(name: str | None) -> Checkpoint:
    return Checkpoint(
        _new_id(), "i" + "a" * 20, name, "2026-01-01T00:00:00Z", "snapshot:s", "s", ("l",), 1, 512
    )


@pytest.mark.parametrize("name", ["start", "cpu-run", "step.17", "A_b-c", "x" * 64])
def test_names_taken(name: str) -> None:
    Checkpoints._check_name(name, [checkpoint("other")])


@pytest.mark.parametrize("name", ["", "-a", "../x", "a b", "x" * 65, _new_id()])
def test_names_refused(name: str) -> None:
    with pytest.raises(InvalidCheckpoint):
        Checkpoints._check_name(name, [])


def test_a_taken_name_or_a_full_sandbox_is_a_conflict() -> None:
    with pytest.raises(CheckpointConflict, match="named 'start'"):
        Checkpoints._check_name("start", [checkpoint("start")])
    with pytest.raises(CheckpointConflict, match="at most"):
        Checkpoints._check_name(None, [checkpoint(None)] * MAX_CHECKPOINTS)


class _Host:
    def __init__(self, root: Path):
        self.root = root

    def workdir(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id


def test_a_take_over_leaves_checkpoints_behind_and_says_so(tmp_path: Path) -> None:
    """The pause snapshot names the paused sandbox's checkpoints; the node that took it over
    answers for them that they stayed on the node it came from."""
    before = Checkpoints(_Host(tmp_path / "a"), None, None, None, None)  # type: ignore[arg-type]
    after = Checkpoints(_Host(tmp_path / "b"), None, None, None, None)  # type: ignore[arg-type]
    kept = checkpoint("start")
    record = before._root(kept.sandbox_id) / kept.checkpoint_id / RECORD
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps(asdict(kept)))
    metadata = before.carried(kept.sandbox_id, "node-a")
    assert before.carried("another", "node-a") == {}

    (tmp_path / "b" / kept.sandbox_id).mkdir(parents=True)
    after.left_behind(kept.sandbox_id, metadata)
    assert after.list(kept.sandbox_id) == []
    for reference in ("start", kept.checkpoint_id):
        with pytest.raises(CheckpointNotFound, match="stayed on node node-a"):
            after.get(kept.sandbox_id, reference)
    with pytest.raises(CheckpointNotFound) as never:
        after.get(kept.sandbox_id, "never-made")
    assert "stayed" not in str(never.value)
