"""Which checkpoint names a sandbox takes (`Checkpoints._check_name`), without a VM."""

from __future__ import annotations

import pytest

from aenv.snapshot.checkpoints import (
    MAX_CHECKPOINTS,
    Checkpoint,
    CheckpointConflict,
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
