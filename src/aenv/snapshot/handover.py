"""Durable pauses: a paused sandbox committed to a shared repository, so another node resumes it.

On a node whose repository is shared (an s3 one), a pause answers as soon as its state is on the
node's disk, as every pause does; then, in the background, that state is committed to the
repository as a hidden snapshot (the *pause snapshot*): the pause's memory delta and device
state, and every layer of the sandbox's disk chain, its writable top layer included (uploaded
while nothing writes to it: the VM is stopped). Its alias `aenv.pause.<sandbox id>` lets any
node find it by sandbox id, and its metadata carry the sandbox's record as the node service
describes it (`describe`), so the node taking it over knows the sandbox's tokens and settings.
`SandboxState.durable` names it once it is committed: until then the pause is on this node only.

A resume or kill here does not wait for the upload: it supersedes it (`claim`). A superseded
upload never commits its manifest (checked under the same lock as the commit, so the upload
either committed before, and the pause is claimed as any durable one, or never will), and
stops at its next step; what it stored already is unnamed and goes with the collector's grace
rule. The files it reads stay as they were: the pause's memory files are immutable, and a
resume here gives the sandbox a new writable layer over the paused one (`Lifecycle.resume`).

Who continues the sandbox is decided once, by the repository's claim on the pause snapshot (a
conditional write): a resume here, a kill here and a take-over elsewhere each claim it first,
and the loser backs off. The node that loses a paused sandbox this way considers it gone
(`SandboxMoved`). A take-over starts the sandbox from the pause snapshot like any snapshot,
with the same sandbox id; the pause snapshot is then deleted, deferred until that sandbox ends.
A sandbox killed through a gateway while its node is down is over for good: another node claims
its pause snapshot the same way and deletes it (`discard`), as its node may never come back to.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..events import EventBus, PauseDurable, PauseSaved
from ..network.egress import EgressPolicy
from ..repository.contract import Repository
from ..repository.manifest import SnapshotManifest, new_snapshot_id, utc_now
from ..runtime.contract import RuntimeResolver
from .host import Host, StopDeadline
from .model import DISK_ONLY, EngineError, GuestInit, SandboxState, SandboxVM

log = logging.getLogger(__name__)

PAUSE_MARK = "aenv.paused-sandbox"  # metadata of a pause snapshot: the id of the paused sandbox
PAUSED_ON = "aenv.paused-on"  # metadata of a pause snapshot: the node it was paused on


# How a sandbox starts from a snapshot here (`Lifecycle.start`): snapshot, sandbox id, init, policy.
Start = Callable[[str, str, GuestInit, EgressPolicy], Awaitable[SandboxVM]]
# The metadata a sandbox's pause snapshot carries to the node taking it over (its id -> them).
Describe = Callable[[str], dict[str, str]]
# What a pause says of the sandbox's checkpoints that stay on its node (sandbox id, node) → metadata.
Carried = Callable[[str, str], dict[str, str]]


def pause_alias(sandbox_id: str) -> str:
    return f"aenv.pause.{sandbox_id}"


class Superseded(Exception):
    """The paused sandbox was resumed or killed here before its upload committed (its id)."""


@dataclass
class _Upload:
    """A pause being committed to the repository, and whether a resume or kill superseded it."""

    state: SandboxState  # a copy, as paused: the sandbox's own state moves on
    superseded: bool = False
    committed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    task: asyncio.Task[None] | None = None

    def check(self) -> None:
        if self.superseded:
            raise Superseded(self.state.sandbox_id)


class SandboxMoved(EngineError):
    """Another node claimed the paused sandbox: it continues there, and is gone from here."""

    def __init__(self, sandbox_id: str, node: str):
        super().__init__(f"sandbox {sandbox_id} was taken over by node {node}")
        self.node = node


class PauseReclaimed(EngineError):
    """The node the sandbox was paused on claimed its pause back: it resumed or ended the
    sandbox there, after it last said the pause was durable."""

    def __init__(self, sandbox_id: str, node: str):
        super().__init__(f"sandbox {sandbox_id} was resumed or ended on node {node}, where it was paused")
        self.node = node


class Handover:
    """Commits pauses to the repository in the background and hands paused sandboxes over."""

    def __init__(
        self,
        host: Host,
        repository: Repository,
        runtime: RuntimeResolver,
        stop: StopDeadline,
        enabled: bool,
        events: EventBus | None = None,
        describe: Describe | None = None,
        carried: Carried | None = None,
    ):
        self.host = host
        self.repository, self.runtime, self.stop = repository, runtime, stop
        self.enabled = enabled
        # The sandbox's description carried by its pause snapshot (the node's record of it).
        self.describe: Describe = describe or (lambda sandbox_id: {})
        # What it says of the sandbox's checkpoints, which stay here (`aenv.snapshot.checkpoints`).
        self.carried: Carried = carried or (lambda sandbox_id, node: {})
        # Told `PauseDurable` when a pause is committed, so the node can report it as durable.
        self.events = events or EventBus()
        self.events.subscribe(PauseSaved, lambda saved: self.paused(saved.state, saved.origin))
        self._uploads: dict[str, _Upload] = {}

    @property
    def node(self) -> str:
        return self.repository.node  # type: ignore[attr-defined,no-any-return]

    # -- this node's side: commit after the pause, claim before a resume or kill ---------------

    def paused(self, state: SandboxState, origin: SnapshotManifest) -> None:
        """The pause is on this node's disk: commit it to the repository in the background."""
        if not self.enabled or state.durable is not None:
            return
        metadata = {
            **self.describe(state.sandbox_id),
            **self.carried(state.sandbox_id, self.node),
            PAUSE_MARK: state.sandbox_id,
            PAUSED_ON: self.node,
        }
        upload = _Upload(dataclasses.replace(state, disk_layers=list(state.disk_layers)))
        upload.task = asyncio.create_task(self._upload(upload, state, origin, metadata))
        self._uploads[state.sandbox_id] = upload
        upload.task.add_done_callback(lambda _: self._forget(state.sandbox_id, upload))

    def _forget(self, sandbox_id: str, upload: _Upload) -> None:
        if self._uploads.get(sandbox_id) is upload:
            del self._uploads[sandbox_id]

    async def close(self) -> None:
        """Let running uploads finish, until the stop deadline (`StopDeadline.settle`): a node stopping
        with its store reachable leaves its pauses durable; the others stay on its disk and are
        committed at its next start (`recover`)."""
        if left := await self.stop.settle(u.task for u in list(self._uploads.values())):
            log.warning("%d pauses not committed by the stop deadline: committed at the next start", left)

    def recover(self, state: SandboxState) -> None:
        """After a restart: commit a pause the previous node process had not committed yet."""
        if not (self.enabled and state.paused and state.durable is None and state.pid is None):
            return
        try:
            origin = self.repository.leased(state.snapshot_id, state.sandbox_id)
        except Exception as exc:  # the pause stays on this node, resumable here as before
            log.error("cannot commit the pause of sandbox %s: %s", state.sandbox_id, exc)
            return
        self.paused(state, origin)

    async def supersede(self, sandbox_id: str) -> bool:
        """Before a resume or kill here: stop the sandbox's upload from ever committing.

        True if an upload was superseded (it may still read the pause's files a while: a resume
        must not write them); False if none runs, or it committed already (then it has ended
        and the saved state names the pause snapshot).
        """
        upload = self._uploads.get(sandbox_id)
        if upload is None:
            return False
        with upload.lock:
            upload.superseded = not upload.committed
        if upload.superseded:
            log.info("pause upload of sandbox %s superseded: it resumes or ends here", sandbox_id)
            return True
        if upload.task is not None:
            await asyncio.shield(upload.task)  # committed: only the saved state is left to write
        return False

    async def _upload(
        self, upload: _Upload, state: SandboxState, origin: SnapshotManifest, metadata: dict[str, str]
    ) -> None:
        try:
            manifest = await asyncio.to_thread(self._commit, upload, origin, metadata)
        except Exception as exc:  # the pause stays on this node; a restart or the next pause tries again
            if upload.superseded:  # its files may be gone by now (a kill): not an error
                log.info("pause upload of sandbox %s stopped, superseded (%r)", state.sandbox_id, exc)
                return
            log.exception("committing the pause of sandbox %s to the repository failed", state.sandbox_id)
            return
        state.durable = manifest.id
        state.save(self.host.workdir(state.sandbox_id))
        self.events.publish(PauseDurable(state.sandbox_id))
        log.info("pause of sandbox %s is durable as %s", state.sandbox_id, manifest.id)

    def _commit(
        self, upload: _Upload, origin: SnapshotManifest, metadata: dict[str, str]
    ) -> SnapshotManifest:
        """Upload the pause's files and commit its manifest, unless superseded (blocking: run in
        a worker thread)."""
        repository, state = self.repository, upload.state
        device_state, deltas, sizes = origin.device_state, (), {}
        if state.disk_only or state.delta is None or state.devices is None:
            metadata = {**metadata, DISK_ONLY: "true"}
        else:
            delta = repository.put_blob(state.delta)
            upload.check()
            device_state, deltas = repository.put_blob(state.devices), (delta,)
            sizes = {delta: Path(state.delta).stat().st_size}
        upload.check()
        layers = self.runtime.publish_layers(state.disk_layers)
        manifest = SnapshotManifest(
            id=new_snapshot_id(), kind="snapshot", alias=pause_alias(state.sandbox_id), created_at=utc_now(),
            source={"sandbox_id": state.sandbox_id, "snapshot_id": origin.id}, machine=origin.machine,
            memory_image=origin.memory_image, memory_deltas=deltas, device_state=device_state,
            vmstate_prefix=origin.vmstate_prefix, disk_layers=layers,
            runtime=origin.runtime, metadata=metadata, sizes=sizes,
        )  # fmt: skip
        with upload.lock:
            upload.check()
            repository.commit(manifest)
            upload.committed = True
        return manifest

    async def claim(self, state: SandboxState) -> str | None:
        """Before this node resumes or kills the paused sandbox: make sure nobody took it over.

        Returns the pause snapshot now claimed by this node (None if the pause is not durable).
        An upload still running is superseded first (`supersede`), never waited for. The saved
        state is read again: `state` may predate an upload that committed.
        """
        await self.supersede(state.sandbox_id)
        with contextlib.suppress(OSError, ValueError):
            state.durable = self.host.load_state(state.sandbox_id).durable
        if state.durable is None:
            return None
        winner = await asyncio.to_thread(self.repository.claim, state.durable)
        if winner != self.node:
            raise SandboxMoved(state.sandbox_id, winner)
        return state.durable

    async def unclaim(self, pause: str | None) -> None:
        """A resume here failed: the paused sandbox may be taken over again."""
        if pause is not None:
            await asyncio.to_thread(self.repository.unclaim, pause)

    async def retire(self, state: SandboxState, pause: str | None) -> None:
        """The sandbox resumed or ended here: its pause snapshot (claimed by this node) goes."""
        if pause is None:
            return
        state.durable = None
        with contextlib.suppress(FileNotFoundError):  # a killed sandbox's directory is gone
            state.save(self.host.workdir(state.sandbox_id))
        await asyncio.to_thread(self._delete, pause)

    def moved(self, state: SandboxState) -> str | None:
        """The node that took the paused sandbox over, if another one did (blocking)."""
        if state.durable is None:
            return None
        winner = self.repository.claimant(state.durable)
        return winner if winner not in (None, self.node) else None

    def _delete(self, snapshot_id: str) -> None:
        try:
            self.repository.delete(snapshot_id, defer=True)
        except Exception as exc:  # gone already, or the store is away: gc finds it unclaimed later
            log.warning("deleting pause snapshot %s failed: %s", snapshot_id, exc)

    # -- the other node's side: take a paused sandbox over -------------------------------------

    def find(self, sandbox_id: str) -> SnapshotManifest:
        """The committed pause of a sandbox paused on any node (`SnapshotNotFound` if none)."""
        return self.repository.get(pause_alias(sandbox_id))

    async def take_over(
        self, start: Start, pause: SnapshotManifest, init: GuestInit, policy: EgressPolicy
    ) -> SandboxVM:
        """Claim the pause snapshot and continue the sandbox from it here, under the same id.

        Raises `PauseReclaimed` if the node it was paused on holds the claim, `SandboxMoved` if
        another node does."""
        sandbox_id = pause.metadata[PAUSE_MARK]
        winner = await asyncio.to_thread(self.repository.claim, pause.id)
        if winner != self.node:
            gone = PauseReclaimed if winner == pause.metadata.get(PAUSED_ON) else SandboxMoved
            raise gone(sandbox_id, winner)
        try:
            sandbox = await start(pause.id, sandbox_id, init, policy)
        except BaseException:
            await asyncio.to_thread(self.repository.unclaim, pause.id)
            raise
        await asyncio.to_thread(self._delete, pause.id)  # hidden now, removed when the sandbox ends
        return sandbox

    async def discard(self, sandbox_id: str) -> str:
        """Claim and delete the pause snapshot of a sandbox that ended while its node was away
        (killed through a gateway); returns its id.

        Claimed first, as a take-over would: a take-over under way elsewhere, or the pausing node
        back and resuming or killing the sandbox itself, is decided by the same one claim, and
        the loser backs off (`SandboxMoved` here). A delete that fails gives the claim back, so
        the pausing node's own kill still removes the pause when it is back.
        """
        pause = await asyncio.to_thread(self.find, sandbox_id)
        winner = await asyncio.to_thread(self.repository.claim, pause.id)
        if winner != self.node:
            raise SandboxMoved(sandbox_id, winner)
        try:
            await asyncio.to_thread(self.repository.delete, pause.id, defer=True)
        except BaseException:
            await asyncio.to_thread(self.repository.unclaim, pause.id)
            raise
        return pause.id
