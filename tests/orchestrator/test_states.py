"""The transition table and its guard: which operation runs from which state, and what it leaves."""

from __future__ import annotations

import pytest

from aenv.orchestrator.errors import Conflict, NotFound
from aenv.orchestrator.states import TRANSITIONS, Op, State, api_state, transition

from .conftest import record


def test_every_operation_has_one_rule_and_states_round_trip_as_strings() -> None:
    assert set(TRANSITIONS) == set(Op)
    assert record("paused").state is State.PAUSED  # type: ignore[arg-type]  # a stored row's string
    assert [api_state(s) for s in (State.PAUSING, State.PAUSED, State.RESUMING)] == ["paused"] * 2 + [
        "running"
    ]


def test_success_settles_in_the_target_and_persists_once() -> None:
    saved: list[State] = []
    sandbox = record(State.RUNNING)
    with transition(sandbox, Op.PAUSE, lambda r: saved.append(r.state)):
        assert sandbox.state is State.PAUSING  # shown while the work runs
        assert saved == []
    assert sandbox.state is State.PAUSED and saved == [State.PAUSED]
    with transition(sandbox, Op.RESUME, lambda r: saved.append(r.state)):
        assert sandbox.state is State.RESUMING
    assert sandbox.state is State.RUNNING
    with transition(sandbox, Op.SNAPSHOT, lambda r: saved.append(r.state)):
        assert sandbox.state is State.SNAPSHOTTING
    assert sandbox.state is State.RUNNING  # back where it started


def test_each_settled_change_of_state_is_a_new_generation() -> None:
    """The cluster orders reports of a sandbox by its generation: one per settled change."""
    sandbox = record(State.RUNNING)
    generations = [sandbox.generation]
    for op in (Op.PAUSE, Op.RESUME, Op.SNAPSHOT, Op.EXTEND):
        with transition(sandbox, op, lambda r: None):
            assert sandbox.generation == generations[-1]  # a report meanwhile has the last one
        generations.append(sandbox.generation)
    assert generations == [0, 1, 2, 2, 2]  # a snapshot or a new timeout leaves the state as it was
    with pytest.raises(RuntimeError), transition(sandbox, Op.PAUSE, lambda r: None):
        raise RuntimeError("QEMU went away")
    assert sandbox.generation == 2


def test_failure_returns_to_the_source_state_without_persisting() -> None:
    saved: list[State] = []
    sandbox = record(State.RUNNING)
    with pytest.raises(RuntimeError), transition(sandbox, Op.FORK, lambda r: saved.append(r.state)):
        raise RuntimeError("QEMU went away")
    assert sandbox.state is State.RUNNING and saved == []


def test_a_removed_sandbox_is_not_persisted_again() -> None:
    saved: list[State] = []
    sandbox = record(State.PAUSED)
    with transition(sandbox, Op.KILL, lambda r: saved.append(r.state)):
        assert sandbox.state is State.KILLING
    assert saved == []


@pytest.mark.parametrize(
    ("state", "op", "error", "words"),
    [
        (State.PAUSED, Op.PAUSE, Conflict, "already paused"),
        (State.PAUSING, Op.PAUSE, Conflict, "already paused"),
        (State.RUNNING, Op.RESUME, Conflict, "already running"),
        (State.PAUSED, Op.SNAPSHOT, Conflict, "cannot be snapshotted while paused"),
        (State.FORKING, Op.FORK, Conflict, "cannot be forked while forking"),
        (State.PAUSED, Op.NETWORK, Conflict, "while paused"),
        (State.PAUSED, Op.EXTEND, NotFound, "is not running"),  # E2B: 404 for a paused sandbox
        (State.KILLING, Op.KILL, NotFound, "not found"),
        (State.KILLING, Op.RESUME, NotFound, "not found"),
    ],
)
def test_refusals_are_the_same_for_the_same_situation(state, op, error, words) -> None:
    sandbox = record(state)
    with pytest.raises(error, match=words), transition(sandbox, op, lambda r: None):
        pytest.fail("the work must not run")
    assert sandbox.state is state
