"""Sandbox states and the one table that says which operation may run from which state.

Every operation on a sandbox goes through `transition`: it refuses the operation from a state
the table does not list (with the error kind the table names, so the same situation always gets
the same answer), shows the operation's transitional state while the work runs, settles in the
table's target state when the work succeeds and falls back to the state it started from when it
fails. Nothing else assigns a sandbox's state, so the API's view of a sandbox is always one of
these transitions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, TypeVar

from .errors import Conflict, NotFound, SandboxError


class State(StrEnum):
    """Internal states; the API shows only `running` or `paused` (see `api_state`)."""

    CREATING = "creating"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    RESUMING = "resuming"
    SNAPSHOTTING = "snapshotting"
    FORKING = "forking"
    KILLING = "killing"


def api_state(state: State) -> str:
    """E2B's two states: a sandbox that is being paused already counts as paused."""
    return "paused" if state in (State.PAUSING, State.PAUSED) else "running"


class Op(StrEnum):
    START = "started"  # a new sandbox (create, a fork's child) becomes running
    PAUSE = "paused"
    RESUME = "resumed"
    SNAPSHOT = "snapshotted"
    FORK = "forked"
    CHECKPOINT = "checkpointed"
    RESET = "reset"  # to one of its checkpoints
    KILL = "killed"
    EXTEND = "given more time"  # set timeout, refresh, connect to a running sandbox
    NETWORK = "given new network rules"
    RECOVER_PAUSED = "recorded as paused"  # at start-up: a sandbox a crash left paused on disk
    ADOPT = "adopted"  # at start-up: a VM that outlived the node process, whatever it was doing


@dataclass(frozen=True)
class Transition:
    sources: frozenset[State]
    via: State | None  # shown while the work runs; None: the state does not change meanwhile
    target: State | None  # after success; None: back to the state it started from
    refusal: type[SandboxError]  # raised when the sandbox is in a state not in `sources`
    removes: bool = False  # after success the sandbox no longer exists


_ALIVE = frozenset(State) - {State.KILLING}

TRANSITIONS: dict[Op, Transition] = {
    Op.START: Transition(frozenset({State.CREATING}), None, State.RUNNING, Conflict),
    Op.PAUSE: Transition(frozenset({State.RUNNING}), State.PAUSING, State.PAUSED, Conflict),
    Op.RESUME: Transition(frozenset({State.PAUSED}), State.RESUMING, State.RUNNING, Conflict),
    Op.SNAPSHOT: Transition(frozenset({State.RUNNING}), State.SNAPSHOTTING, None, Conflict),
    Op.FORK: Transition(frozenset({State.RUNNING}), State.FORKING, None, Conflict),
    Op.CHECKPOINT: Transition(frozenset({State.RUNNING}), State.SNAPSHOTTING, None, Conflict),
    Op.RESET: Transition(frozenset({State.RUNNING}), State.RESUMING, None, Conflict),
    Op.KILL: Transition(_ALIVE, State.KILLING, None, NotFound, removes=True),
    # E2B answers 404 to a timeout change of a sandbox that is not running: the SDK maps it to
    # SandboxNotFoundException.
    Op.EXTEND: Transition(frozenset({State.RUNNING}), None, None, NotFound),
    Op.NETWORK: Transition(frozenset({State.RUNNING}), None, None, Conflict),
    Op.RECOVER_PAUSED: Transition(_ALIVE, None, State.PAUSED, Conflict),
    Op.ADOPT: Transition(_ALIVE, None, State.RUNNING, Conflict),
}


class Stateful(Protocol):
    """What the table reads and moves of a sandbox's record (`store.SandboxRecord`)."""

    sandbox_id: str
    state: State
    generation: int


R = TypeVar("R", bound=Stateful)


def refusal(record: Stateful, op: Op) -> SandboxError:
    """The error for `op` from the record's current state, worded for the client."""
    if record.state == State.KILLING:
        return NotFound(f"sandbox {record.sandbox_id} not found")
    if op is Op.PAUSE and record.state in (State.PAUSING, State.PAUSED):
        return Conflict(f"sandbox {record.sandbox_id} is already paused")
    if op is Op.RESUME and record.state == State.RUNNING:
        return Conflict(f"sandbox {record.sandbox_id} is already running")
    if TRANSITIONS[op].refusal is NotFound:
        return NotFound(f"sandbox {record.sandbox_id} is not running (it is {api_state(record.state)})")
    return Conflict(f"sandbox {record.sandbox_id} cannot be {op.value} while {record.state.value}")


@contextlib.contextmanager
def transition(record: R, op: Op, persist: Callable[[R], None]) -> Iterator[Transition]:
    """Run one operation's state change around the caller's work (the sandbox's lock is held).

    On success the record settles in the table's target state and is persisted (a removed
    sandbox is left to its remover); on failure it goes back to the state it started from. A
    settled state other than the one it started from counts as a new generation of the record.
    """
    rule = TRANSITIONS[op]
    if record.state not in rule.sources:
        raise refusal(record, op)
    source = record.state
    if rule.via is not None:
        record.state = rule.via
    try:
        yield rule
    except BaseException:
        record.state = source
        raise
    if rule.removes:
        return
    record.state = rule.target or source
    if record.state != source:
        record.generation += 1
    persist(record)
