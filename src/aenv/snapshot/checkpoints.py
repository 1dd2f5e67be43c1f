"""Named checkpoints of a running sandbox, and its reset to one of them in place.

A checkpoint is what a pause captures, taken without ending the guest: its device state, the
pages it changed since its memory image (a delta layer) and its disk's writable layer, sealed
under a new one (`migration.seal_disk`, O(1) however much was written). It lives in the
sandbox's directory (`checkpoints/<id>/`) for as long as the sandbox does, on its node only.

A reset restores the sandbox from a checkpoint as a resume restores it from a pause: a QEMU on
the snapshot's memory image, the checkpoint's pages written back, its device state loaded, a
new writable layer over the checkpoint's sealed one, and envd told the sandbox's token, a fresh
clock and entropy. The sandbox keeps its id, record and tokens; only its VM is new. The new VM
is started before the old one ends, so a reset that fails leaves the sandbox running as it was;
the old one ends after the reset answered. Usually the new VM was restored ahead of time, the
sandbox's standby (`aenv.snapshot.standby`), and the reset continues it. Measured (TCG, 2 cores)
until a command ran after it: restoring on the way 450-490 ms (layer and stream 12-21 ms, spawn
28-45 ms, pages and device state 15-24 ms, envd's `/init` 108-150 ms, the old VM's end 21-60 ms,
then the first command 215-230 ms); continuing the standby 367-380 ms (sockets and `cont` 3-10
ms, `/init` 124-133 ms, the first command ~230 ms): what is left is the guest's first answers,
code a new process translates afresh, which a parked resume (50-60 ms) has translated already.

Why a new QEMU process rather than loading the checkpoint into the running one: under TCG the
process's translated code is what a reuse would keep, and loading any CPU state flushes it
(`cpu_common_post_load` calls `tb_flush`: "loadvm has just updated the content of RAM, bypassing
the usual mechanisms..."), so an in-place load would pay the same translation as a new process,
and would still have to turn every page changed since the checkpoint back into the image's
(writing it from outside leaves it private) and rebuild the disk chain under a running device.
A new process costs its spawn (~30 ms here) over that, and reuses the resume path as it is.

Checkpoints stay on the node that took them: they are over its memory image and disk layers,
and a node restart keeps them with the sandbox's directory. A durably paused sandbox that another
node takes over continues from its pause snapshot without them (copying every checkpoint's delta
and layers to the repository would make each durable pause pay for all of them): its pause
snapshot names the checkpoints it had (`LEFT_BEHIND`), the node that took it over records them
(`LEFT_FILE`), and a reset, delete or promotion naming one answers that it stayed behind rather
than that it never existed. The node it came from removes them with the rest of the sandbox.

Lineage: every checkpoint records its parent, the checkpoint the sandbox's state came from (its
last checkpoint or reset), or the snapshot the sandbox started from; snapshots of the sandbox
record the checkpoint too (`source.checkpoint_id`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from ..repository.manifest import SnapshotManifest, utc_now
from ..runtime.contract import RuntimeResolver
from ..runtime.layers import LayerStore, new_layer_id
from ..vmm import devstate, migration
from . import memory
from .clones import Clones
from .host import Host
from .model import EngineError, GuestInit, SandboxState, SandboxVM
from .standby import Standbys

CHECKPOINTS_DIR = "checkpoints"
RECORD = "checkpoint.json"
# A pause snapshot's metadata: the checkpoints (JSON [[id, name], ...]) of the paused sandbox, and
# the node holding them; in a taken-over sandbox's checkpoints directory, the same as a file.
LEFT_BEHIND = "aenv.checkpoints-left"
LEFT_FILE = "left-behind.json"
MAX_CHECKPOINTS = 64  # per sandbox: each holds a delta layer and a disk layer on the node's disk
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
ID = re.compile(r"cp[0-9a-f]{16}")


class CheckpointNotFound(LookupError):
    """No checkpoint of that id or name on the sandbox."""


class InvalidCheckpoint(ValueError):
    """A checkpoint name that cannot be used."""


class CheckpointConflict(ValueError):
    """A checkpoint the sandbox cannot take now: its name is taken, or it keeps too many."""


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint as recorded beside its files."""

    checkpoint_id: str
    sandbox_id: str
    name: str | None
    created_at: str
    parent: str  # a checkpoint id, or "snapshot:<id>" for the snapshot the sandbox started from
    snapshot_id: str  # the memory image and device prefix its state is over
    disk_layers: tuple[str, ...]  # its disk, bottom to top; the top one sealed by the checkpoint
    pages: int  # guest pages its delta layer holds
    memory_mb: int


def _new_id() -> str:
    return "cp" + secrets.token_hex(8)  # of the form `ID`


class Checkpoints:
    """The checkpoints of this node's sandboxes, and resets to them."""

    def __init__(
        self, host: Host, runtime: RuntimeResolver, layers: LayerStore, clones: Clones, standbys: Standbys
    ):
        self.host = host
        self.runtime, self.layers = runtime, layers
        self.clones = clones
        self.standbys = standbys

    def _root(self, sandbox_id: str) -> Path:
        return self.host.workdir(sandbox_id) / CHECKPOINTS_DIR

    def list(self, sandbox_id: str) -> list[Checkpoint]:
        """Oldest first."""
        found = []
        for record in self._root(sandbox_id).glob(f"*/{RECORD}"):
            raw = json.loads(record.read_text())
            found.append(Checkpoint(**{**raw, "disk_layers": tuple(raw["disk_layers"])}))
        return sorted(found, key=lambda c: (c.created_at, c.checkpoint_id))

    def get(self, sandbox_id: str, reference: str) -> Checkpoint:
        """By id or name."""
        for checkpoint in self.list(sandbox_id):
            if reference in (checkpoint.checkpoint_id, checkpoint.name):
                return checkpoint
        message = f"sandbox {sandbox_id} has no checkpoint {reference[:80]!r}"
        left = self._root(sandbox_id) / LEFT_FILE
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            record = json.loads(left.read_text())
            if any(reference in pair for pair in record["checkpoints"]):
                message += (
                    f": it stayed on node {record['node']}, which the sandbox was taken over from "
                    "(checkpoints stay on the node that took them)"
                )
        raise CheckpointNotFound(message)

    def carried(self, sandbox_id: str, node: str) -> dict[str, str]:
        """What a pause snapshot of the sandbox tells a node taking it over of its checkpoints."""
        found = [[c.checkpoint_id, c.name] for c in self.list(sandbox_id)]
        return {LEFT_BEHIND: json.dumps({"node": node, "checkpoints": found})} if found else {}

    def left_behind(self, sandbox_id: str, pause_metadata: dict[str, str]) -> None:
        """Record, for a sandbox just taken over, the checkpoints it had on its former node."""
        if LEFT_BEHIND in pause_metadata:
            root = self._root(sandbox_id)
            root.mkdir(exist_ok=True)
            (root / LEFT_FILE).write_text(pause_metadata[LEFT_BEHIND])

    def files(self, sandbox_id: str, checkpoint: Checkpoint) -> tuple[Path, Path]:
        """The checkpoint's device state and delta layer."""
        directory = self._root(sandbox_id) / checkpoint.checkpoint_id
        return directory / "state.devices", directory / "state.delta"

    async def create(self, sandbox: SandboxVM, name: str | None) -> Checkpoint:
        """Capture the running sandbox (stopped only meanwhile, as a snapshot's capture)."""
        existing = self.list(sandbox.sandbox_id)
        self._check_name(name, existing)
        state, layers = sandbox.state, self.layers
        checkpoint_id = _new_id()
        directory = self._root(sandbox.sandbox_id) / checkpoint_id
        directory.mkdir(parents=True)
        sealed, new_top = state.disk_layers[-1], new_layer_id()
        try:
            async with migration.stopped(sandbox.vm, resume=True):
                _, delta = await self.clones.capture(sandbox, directory, "state", sync=False)
                await migration.seal_disk(sandbox.vm, sandbox.root_node, layers.path(new_top), f"n{new_top}")
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        sandbox.root_node = f"n{new_top}"
        state.disk_layers.append(new_top)
        layers.seal(sealed)
        checkpoint = Checkpoint(
            checkpoint_id=checkpoint_id,
            sandbox_id=sandbox.sandbox_id,
            name=name,
            created_at=utc_now(),
            parent=state.checkpoint or f"snapshot:{state.snapshot_id}",
            snapshot_id=state.snapshot_id,
            disk_layers=tuple(state.disk_layers[:-1]),
            pages=delta.pages,
            memory_mb=sandbox.manifest.machine.memory_mib,
        )
        await asyncio.to_thread(memory.flush_delta, delta.path)
        (directory / RECORD).write_text(json.dumps(asdict(checkpoint)))
        state.checkpoint = checkpoint_id
        state.kept_layers = sorted({*state.kept_layers, *checkpoint.disk_layers})
        state.save(self.host.workdir(sandbox.sandbox_id))
        return checkpoint

    @staticmethod
    def _check_name(name: str | None, existing: list[Checkpoint]) -> None:
        if len(existing) >= MAX_CHECKPOINTS:
            raise CheckpointConflict(f"a sandbox keeps at most {MAX_CHECKPOINTS} checkpoints: delete one")
        if name is None:
            return
        if not NAME.fullmatch(name) or ID.fullmatch(name):
            raise InvalidCheckpoint(
                "a checkpoint name is 1-64 of [A-Za-z0-9._-], starting with a letter or digit, and "
                f"not of a checkpoint id's form (cp and 16 hex digits): {name[:80]!r}"
            )
        if any(c.name == name for c in existing):
            raise CheckpointConflict(f"the sandbox has a checkpoint named {name!r} already")

    def delete(self, sandbox_id: str, reference: str, state: SandboxState | None = None) -> Checkpoint:
        """Remove a checkpoint; its disk layers stay while the sandbox or another checkpoint uses
        them (the node's garbage collection removes them after that). `state`: the running
        sandbox's, which it saves again later (else the saved one is updated)."""
        checkpoint = self.get(sandbox_id, reference)
        self.standbys.drop(sandbox_id, checkpoint.checkpoint_id)
        shutil.rmtree(self._root(sandbox_id) / checkpoint.checkpoint_id)
        state = state or self.host.load_state(sandbox_id)
        state.kept_layers = sorted({layer for c in self.list(sandbox_id) for layer in c.disk_layers})
        state.save(self.host.workdir(sandbox_id))
        return checkpoint

    def prepare_standby(self, sandbox: SandboxVM, checkpoint_id: str) -> None:
        """Restore the checkpoint into a stopped standby in the background (`aenv.snapshot.standby`),
        which the sandbox's next reset to it continues."""
        checkpoint = self.get(sandbox.sandbox_id, checkpoint_id)
        devices, delta = self.files(sandbox.sandbox_id, checkpoint)
        self.standbys.prepare(sandbox, checkpoint_id, devices, delta, checkpoint.disk_layers[-1])

    async def reset(self, sandbox: SandboxVM, reference: str, init: GuestInit) -> SandboxVM:
        """The sandbox restored from a checkpoint in a new VM, which replaces its running one: its
        standby of that checkpoint if it has one, else one restored now.

        The old VM ends only once the new one answers, in the background (with its writable
        layer, which no checkpoint holds): if the restore fails, the sandbox runs on as it was
        (its saved state names its old disk and process again)."""
        checkpoint = self.get(sandbox.sandbox_id, reference)
        if checkpoint.snapshot_id != sandbox.state.snapshot_id:
            raise EngineError(f"checkpoint {checkpoint.checkpoint_id} is over another snapshot")
        old = sandbox.state
        standby = await self.standbys.take(old.sandbox_id, checkpoint.checkpoint_id, old.policy)
        sealed = checkpoint.disk_layers[-1]
        top = standby.top_layer if standby is not None else await self.layers.create_upper(sealed)
        state = type(old)(**{**asdict(old), "disk_layers": [*checkpoint.disk_layers, top]})
        state.checkpoint, state.network_name = checkpoint.checkpoint_id, f"aenv-{old.sandbox_id}"
        try:
            if standby is not None:
                fresh = await self.standbys.activate(standby, state, sandbox.manifest, init)
            else:
                fresh = await self._restore(checkpoint, state, sandbox.manifest, init)
        except BaseException:
            self.layers.remove(top)
            old.save(self.host.workdir(old.sandbox_id))
            raise
        self.standbys.retire(sandbox.guest, old.disk_layers[-1])
        return fresh

    async def _restore(
        self, checkpoint: Checkpoint, state: SandboxState, manifest: SnapshotManifest, init: GuestInit
    ) -> SandboxVM:
        """The checkpoint restored into a new QEMU now, on `state`'s disk."""
        devices, delta = self.files(state.sandbox_id, checkpoint)
        stream = self._root(state.sandbox_id) / checkpoint.checkpoint_id / "reset.vmstate"
        prefix = self.runtime.vmstate_prefix(manifest)
        stream.write_bytes(devstate.splice(prefix, devices.read_bytes()))
        try:
            return await self.clones.launch(state, manifest, [delta], stream, init)
        finally:
            stream.unlink(missing_ok=True)
