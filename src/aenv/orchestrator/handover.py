"""Durable pauses on the orchestrator's side: sandboxes moving between nodes sharing a repository.

A pause committed to the shared repository (`aenv.snapshot.handover`) makes the sandbox
durable: another node can take it over, from the record its pause carries (`pause_metadata`).
This node then forgets it (`forget_moved`), and a node may delete the pause of a sandbox killed
while its own node is down (`discard_pause`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import asdict

from ..events import EventBus, PauseDurable
from ..repository.errors import InvalidName, RepositoryError, SnapshotNotFound
from ..snapshot.handover import Describe, Handover, PauseReclaimed, SandboxMoved
from .admission import Admission
from .backend import SandboxBackend
from .errors import NOT_SHARED, PAUSE_GONE, Conflict, NotFound, OperationFailed
from .launch import LaunchPlan
from .lifecycle import Lifecycle
from .sandboxes import Sandbox, SandboxTable
from .states import Op, State
from .store import SandboxRecord, SandboxStore

log = logging.getLogger(__name__)

# A pause snapshot's metadata: the sandbox's record, for the node that takes the sandbox over.
SANDBOX_RECORD = "aenv.sandbox-record"
MOVED_CHECK_SECONDS = 30.0  # how often durably paused sandboxes are checked for a take-over elsewhere


def pause_metadata(store: SandboxStore) -> Describe:
    """What a sandbox's pause snapshot carries to the node taking it over: its record as this node
    stored it (every settled change and the start of every operation are stored, a pause's too)."""

    def describe(sandbox_id: str) -> dict[str, str]:
        record = store.get(sandbox_id)
        return {} if record is None else {SANDBOX_RECORD: json.dumps(asdict(record))}

    return describe


class PauseHandover:
    """Take-overs, discards and moves of the sandboxes of `table`, over the engine's `handover`."""

    def __init__(
        self,
        engine: SandboxBackend,
        handover: Handover,
        table: SandboxTable,
        lifecycle: Lifecycle,
        admission: Admission,
        events: EventBus,
    ):
        self.engine = engine
        self.handover = handover
        self.table = table
        self.lifecycle = lifecycle
        self.admission = admission
        events.subscribe(PauseDurable, lambda durable: self._durable(durable.sandbox_id))

    @property
    def enabled(self) -> bool:
        """Whether pauses are committed to a repository other nodes share."""
        return self.handover.enabled

    def _durable(self, sandbox_id: str) -> None:
        """The sandbox's pause was committed to the repository: say so from now on."""
        sandbox = self.table.find(sandbox_id)
        if sandbox is not None and sandbox.record.state in (State.PAUSING, State.PAUSED):
            sandbox.record.durable = True
            sandbox.record.generation += 1
            self.table.persist(sandbox.record)  # the scheduler may now resume it on another node

    async def forget_moved(self) -> None:
        """Drop the durably paused sandboxes another node has taken over meanwhile."""
        for sandbox in self.table.held():
            if sandbox.record.state != State.PAUSED or not sandbox.record.durable or sandbox.lock.locked():
                continue
            with contextlib.suppress(OSError, ValueError):
                state = self.engine.load_state(sandbox.id)
                if moved_to := await asyncio.to_thread(self.handover.moved, state):
                    async with sandbox.lock:
                        if sandbox.record.state == State.PAUSED and sandbox.id in self.table:
                            await self.lifecycle.moved(sandbox, moved_to)

    async def take_over(self, sandbox_id: str, timeout: int | None) -> Sandbox:
        """Continue here a sandbox paused on another node, from its pause in the repository.

        Its record (tokens, settings, metadata) comes with the pause; the repository's claim
        makes sure only one node continues it, and the node it was paused on forgets it.
        """
        timeout = self.lifecycle.timeout(timeout)
        if sandbox_id in self.table:
            raise Conflict(f"sandbox {sandbox_id} is on this node: resume it instead")
        try:
            pause = await asyncio.to_thread(self.handover.find, sandbox_id)
            paused = SandboxRecord(**json.loads(pause.metadata[SANDBOX_RECORD]))
        except (SnapshotNotFound, InvalidName):
            gone = f"sandbox {sandbox_id} has no durable pause in the repository"
            raise NotFound(gone, PAUSE_GONE) from None
        except (KeyError, ValueError, TypeError) as exc:
            raise OperationFailed(f"the pause of sandbox {sandbox_id} carries no readable record") from exc
        except RepositoryError as exc:
            raise OperationFailed(f"reading the pause of sandbox {sandbox_id} failed: {exc}") from exc
        self.admission.check_start(f"take over sandbox {sandbox_id}", paused.memory_mb)
        plan = LaunchPlan.take_over(paused, timeout)
        sandbox = self.table.add(plan.record)
        async with sandbox.lock:
            try:
                with self.table.transition(sandbox, Op.START):
                    vm = await self.engine.take_over(pause, plan.init, plan.policy)
                    self.lifecycle.attach(sandbox, vm)
                    sandbox.set_end(timeout)
            except PauseReclaimed as exc:
                self.table.forget(sandbox)
                raise NotFound(f"sandbox {sandbox_id} has no durable pause: {exc}", PAUSE_GONE) from exc
            except SandboxMoved as exc:
                self.table.forget(sandbox)
                raise Conflict(str(exc)) from exc
            except Exception as exc:  # the claim is given back: another attempt may succeed
                self.table.forget(sandbox)
                log.exception("taking over sandbox %s failed", sandbox_id)
                raise OperationFailed(f"taking over sandbox {sandbox_id} failed: {exc}") from exc
        self.table.clear_lost(sandbox_id)
        return sandbox

    async def discard_pause(self, sandbox_id: str) -> None:
        """Delete the durable pause of a sandbox killed while the node it was paused on is down.

        Only a shared repository holds other nodes' pauses: a node without one says so
        (`NOT_SHARED`), and a gateway asks another node.
        """
        if sandbox_id in self.table:
            raise Conflict(f"sandbox {sandbox_id} is on this node: kill it instead")
        if not self.handover.enabled:
            raise Conflict(
                "this node's repository is its own (not shared): it holds no pause of another "
                "node's sandbox", NOT_SHARED,
            )  # fmt: skip
        try:
            pause = await self.handover.discard(sandbox_id)
        except (SnapshotNotFound, InvalidName):
            raise NotFound(f"sandbox {sandbox_id} has no durable pause in the repository") from None
        except SandboxMoved as exc:
            raise Conflict(f"the pause of sandbox {sandbox_id} is claimed by node {exc.node}") from exc
        except Exception as exc:  # the claim, if taken, was given back: a later discard may succeed
            log.exception("discarding the pause of sandbox %s failed", sandbox_id)
            raise OperationFailed(f"discarding the pause of sandbox {sandbox_id} failed: {exc}") from exc
        log.info("discarded pause %s of sandbox %s, killed while its node was down", pause, sandbox_id)
