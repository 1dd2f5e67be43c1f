"""One typed event path: what happened to a sandbox or a template, for whoever reacts to it.

Producers publish an event on the node's `EventBus`; subscribers register for its type when
they are built (the node's proxy, the cluster membership, the handover of pauses, the warm
pools, the orchestrator). Reading this module and the `subscribe` calls tells who reacts to
what, which single-slot callbacks assigned after construction hid. Events carry only ids and
values, never a handle to the producer.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from .repository.manifest import SnapshotManifest
    from .snapshot.model import SandboxState


class Event:
    """Base of the events; a subscription names one concrete subclass."""


@dataclass(frozen=True)
class SandboxChanged(Event):
    """A sandbox's state settled, or it is gone: where it stands changed (the cluster binds it)."""

    sandbox_id: str


@dataclass(frozen=True)
class SandboxStopped(Event):
    """A sandbox's VM stopped or was replaced (pause, kill, reset): its connections go."""

    sandbox_id: str


@dataclass(frozen=True)
class SandboxLost(Event):
    """A sandbox's VM died without the node ending it (kill -9, a crash, the host's OOM killer)."""

    sandbox_id: str
    reason: str


@dataclass(frozen=True)
class PauseSaved(Event):
    """A pause is wholly on this node's disk (`origin`: the snapshot the sandbox runs from)."""

    state: SandboxState
    origin: SnapshotManifest


@dataclass(frozen=True)
class PauseDurable(Event):
    """A sandbox's pause is committed to the shared repository: another node may take it over."""

    sandbox_id: str


@dataclass(frozen=True)
class SnapshotFailed(Event):
    """A snapshot answered earlier failed to commit and was rolled back."""

    manifest: SnapshotManifest


@dataclass(frozen=True)
class TemplateBuilt(Event):
    """A user build made a template; the snapshots of the builds it `replaced` are gone."""

    snapshot_id: str
    replaced: tuple[str, ...] = ()


E = TypeVar("E", bound=Event)
Handler = Callable[[E], None] | Callable[[E], Awaitable[None]]


class EventBus:
    """Subscribers by event type, called in the order they subscribed.

    `publish` is for producers that cannot wait (inside a state transition, a task's done
    callback): its subscribers must be plain functions that do not block. `deliver` awaits
    coroutine subscribers too, for producers whose caller must see the reaction done (a
    template build is ready once its warm pool is set).
    """

    def __init__(self) -> None:
        self._handlers: defaultdict[type[Event], list[Callable[[Any], Any]]] = defaultdict(list)

    def subscribe(self, kind: type[E], handler: Handler[E]) -> None:
        self._handlers[kind].append(handler)

    def publish(self, event: Event) -> None:
        for handler in self._handlers[type(event)]:
            if inspect.iscoroutinefunction(handler):
                raise TypeError(f"{handler!r} awaits: {type(event).__name__} is delivered, not published")
            handler(event)

    async def deliver(self, event: Event) -> None:
        for handler in self._handlers[type(event)]:
            result = handler(event)
            if inspect.isawaitable(result):
                await result
