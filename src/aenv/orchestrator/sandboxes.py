"""The sandboxes this node holds: the table every job of the orchestrator works on.

One `Sandbox` per id: its record, its VM while it runs, its lock. Every change of a sandbox's
state goes through `transition` (the table of `states.py`) under its lock, is stored and
published (`SandboxChanged`), so the jobs (`lifecycle`, `recovery`, `handover`, `eviction`)
share one truth and none of them reaches into another's. Sandboxes that died under the node
are remembered with the reason (`lost`), so a lookup answers 404 saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from .. import clock
from ..clock import rfc3339
from ..events import Event, EventBus, SandboxChanged, SandboxStopped
from ..snapshot.model import SandboxVM
from .errors import NotFound
from .metrics import SampleWatch
from .states import Op, State, Transition, transition
from .store import SandboxRecord, SandboxStore

LOST_KEPT = 1000  # how many lost sandboxes the node still explains (404 with the reason)


def parse_time(value: str) -> datetime:
    return datetime.fromisoformat(value)


@dataclass
class Sandbox:
    """A sandbox as the node holds it: its record, its VM while running, its lock."""

    record: SandboxRecord
    vm: SandboxVM | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    samples: SampleWatch = field(default_factory=SampleWatch)

    @property
    def id(self) -> str:
        return self.record.sandbox_id

    def set_end(self, timeout: int) -> None:
        """It runs from now on for `timeout` seconds."""
        self.record.paused_at = None
        self.record.end_at = rfc3339(clock.now() + timedelta(seconds=timeout))

    def extend(self, timeout: int) -> None:
        """Move the end time later, never earlier (connect and refreshes)."""
        wanted = clock.now() + timedelta(seconds=timeout)
        if wanted > parse_time(self.record.end_at):
            self.record.end_at = rfc3339(wanted)


class SandboxTable:
    """Sandboxes by id, stored in `store`, their changes published on `events`."""

    def __init__(self, store: SandboxStore, events: EventBus):
        self.store = store
        self.events = events
        self.sandboxes: dict[str, Sandbox] = {}
        # Sandboxes whose VM died under them, newest last: a lookup says why they are gone.
        self.lost: dict[str, str] = {}

    def get(self, sandbox_id: str) -> Sandbox:
        sandbox = self.sandboxes.get(sandbox_id.split("-", 1)[0])
        if sandbox is None or sandbox.record.state == State.KILLING:
            if reason := self.lost.get(sandbox_id.split("-", 1)[0]):
                raise NotFound(f"sandbox {sandbox_id} was lost: {reason}")
            raise NotFound(f"Sandbox \"{sandbox_id}\" doesn't exist or you don't have access to it")
        return sandbox

    def __contains__(self, sandbox_id: str) -> bool:
        return sandbox_id in self.sandboxes

    def stored(self) -> list[SandboxRecord]:
        """Every record in the store (at start: what the previous node process left)."""
        return self.store.all()

    def hold(self, sandbox: Sandbox) -> None:
        """Hold a sandbox whose record its caller stores (one loaded at start, a fork's child)."""
        self.sandboxes[sandbox.id] = sandbox

    def held(self) -> list[Sandbox]:
        """Every sandbox this node holds, in any state."""
        return list(self.sandboxes.values())

    def find(self, sandbox_id: str) -> Sandbox | None:
        """The sandbox of exactly this id, in any state; None if this node holds none."""
        return self.sandboxes.get(sandbox_id)

    def add(self, record: SandboxRecord) -> Sandbox:
        """A sandbox starting here (in `creating`): held and stored from now on."""
        sandbox = Sandbox(record)
        self.sandboxes[record.sandbox_id] = sandbox
        self.store.put(record)
        return sandbox

    def transition(self, sandbox: Sandbox, op: Op) -> contextlib.AbstractContextManager[Transition]:
        """One operation's state change (`states.transition`); the caller holds the sandbox's lock."""
        if sandbox.id not in self.sandboxes:
            raise NotFound(f"sandbox {sandbox.id} not found")
        return transition(sandbox.record, op, self.persist)

    def persist(self, record: SandboxRecord) -> None:
        self.store.put(record)
        self.events.publish(SandboxChanged(record.sandbox_id))

    @contextlib.asynccontextmanager
    async def operation(self, sandbox: Sandbox, op: Op) -> AsyncIterator[Transition]:
        """Take the sandbox's lock, then run `op`'s state change around the caller's work."""
        async with sandbox.lock:
            with self.transition(sandbox, op) as rule:
                yield rule

    def stopped(self, sandbox: Sandbox) -> None:
        """The sandbox's VM is gone (paused): drop its connections and its handle."""
        sandbox.samples.stopped(time.monotonic())
        self.events.publish(SandboxStopped(sandbox.id))
        sandbox.vm = None
        sandbox.record.paused_at = sandbox.record.paused_at or rfc3339(clock.now())

    def killed(self, sandbox: Sandbox) -> None:
        """The sandbox's VM is ended for good: its connections, its handle and its record go."""
        self.events.publish(SandboxStopped(sandbox.id))
        sandbox.vm = None
        self.forget(sandbox)

    def publish(self, event: Event) -> None:
        self.events.publish(event)

    def forget(self, sandbox: Sandbox) -> None:
        self.sandboxes.pop(sandbox.id, None)
        self.store.delete(sandbox.id)
        self.events.publish(SandboxChanged(sandbox.id))

    def lose(self, sandbox_id: str, reason: str) -> None:
        """Remember why a sandbox is gone, so a lookup answers 404 with the reason."""
        self.lost[sandbox_id] = reason
        while len(self.lost) > LOST_KEPT:
            self.lost.pop(next(iter(self.lost)))

    def clear_lost(self, sandbox_id: str) -> None:
        """The sandbox lives again (taken over here): lookups no longer say it was lost."""
        self.lost.pop(sandbox_id, None)
