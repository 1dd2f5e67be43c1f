"""The sandbox lifecycle: start, resume, snapshot, fork, kill, and egress policy changes.

A sandbox starts from a committed snapshot (a warm VM when the pool has one, else a fresh
restore) on a new writable disk layer over the snapshot's sealed ones, and holds a repository
lease on that snapshot until it is killed. A snapshot of a running sandbox stops it only for the
capture: its device state and changed pages go to staging, its writable layer is sealed under
a new one, and the manifest is committed last. Each capture holds every page the sandbox changed
since the memory image (resume writes earlier pages back as private pages, so they are captured
again): a snapshot has exactly one delta over its image, never a chain. Pausing is
`aenv.snapshot.pausing`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from dataclasses import asdict, replace
from pathlib import Path

from ..network.egress import EgressPolicy
from ..network.netns import SandboxNetwork
from ..repository.contract import Repository
from ..repository.errors import AliasConflict, SnapshotNotFound
from ..repository.manifest import SnapshotManifest, new_snapshot_id, utc_now
from ..repository.names import check_alias
from ..runtime.contract import RuntimeResolver
from ..runtime.layers import LayerStore, new_layer_id
from ..vmm import devstate, migration
from .checkpoints import Checkpoint
from .clones import Clones
from .handover import Handover, SandboxMoved
from .host import Host, StopDeadline
from .model import DISK_ONLY, EngineError, GuestInit, SandboxState, SandboxVM
from .pausing import Pauses, write_out_files
from .pending import CAPTURE, DELTA, DEVICES, PendingSnapshots
from .recovery import kill_stray
from .templates import start_runtime
from .warm import WarmVMs
from .warm_pool import WarmPool, WarmVM

BOOT_TIMEOUT = 300.0  # a cold boot under TCG, on a busy host


class Lifecycle:
    """Runs sandboxes from committed snapshots on this node."""

    def __init__(
        self,
        host: Host,
        repository: Repository,
        runtime: RuntimeResolver,
        layers: LayerStore,
        stop: StopDeadline,
        clones: Clones,
        warm: WarmVMs,
        pool: WarmPool,
        pauses: Pauses,
        handover: Handover,
        pending: PendingSnapshots,
    ):
        self.host = host
        self.repository, self.runtime, self.layers, self.stop = repository, runtime, layers, stop
        self.pending = pending
        self.handover = handover
        self.clones = clones
        self.warm = warm
        self.pool = pool
        self.pauses = pauses

    async def start(
        self, snapshot: str, sandbox_id: str, init: GuestInit, policy: EgressPolicy | None = None
    ) -> SandboxVM:
        """Create a sandbox from a template or snapshot (id or alias), from the warm pool if it can."""
        await self.pending.settle(snapshot)  # one of this node's snapshots, being committed
        manifest = self.repository.get(snapshot)
        warm = self.pool.take(manifest.id)
        # The sandbox's lease pins the snapshot against deletion. A warm VM's lease pins it already,
        # so then it is handed on to the sandbox while the guest takes its `/init` (if it needs
        # one): a durable write (an fsync, or an object store's round trip).
        leasing = asyncio.ensure_future(self._lease(manifest.id, sandbox_id, warm))
        try:
            return await self._start(manifest, sandbox_id, init, policy or EgressPolicy(), warm, leasing)
        finally:
            self.pool.refill(manifest.id)

    async def _lease(self, snapshot_id: str, sandbox_id: str, warm: WarmVM | None) -> None:
        repository = self.repository
        if warm is None:
            await asyncio.to_thread(repository.acquire, snapshot_id, sandbox_id)
        else:
            await asyncio.to_thread(repository.transfer, snapshot_id, warm.entry_id, sandbox_id)

    async def _unlease(self, leasing: asyncio.Future[None], snapshot_id: str, holders: list[str]) -> None:
        """After a failed start: the leases `_lease` took or kept go (releasing is idempotent)."""
        with contextlib.suppress(Exception):
            await leasing
        for holder in holders:
            await asyncio.to_thread(self.repository.release, snapshot_id, holder)

    async def _start(
        self,
        manifest: SnapshotManifest,
        sandbox_id: str,
        init: GuestInit,
        policy: EgressPolicy,
        warm: WarmVM | None,
        leasing: asyncio.Future[None],
    ) -> SandboxVM:
        host = self.host
        holders = [sandbox_id] if warm is None else [sandbox_id, warm.entry_id]
        try:
            if warm is None:
                await leasing  # nothing else pins the snapshot
            await host.check_runnable(manifest)
            top = warm.top_layer if warm else await self.clones.new_top_layer(manifest)
        except BaseException:
            if warm is not None:
                await self.warm.discard(warm)
            await self._unlease(leasing, manifest.id, holders)
            raise
        state = SandboxState(
            sandbox_id=sandbox_id,
            snapshot_id=manifest.id,
            disk_layers=[*manifest.disk_layers, top],
            network_name=warm.network.name if warm else f"aenv-{sandbox_id}",
            policy=asdict(policy),
        )
        try:
            if manifest.metadata.get(DISK_ONLY):
                return await self._boot(state, manifest, init)
            if warm is not None:
                sandbox = await self.warm.claim(warm, state, manifest, init, policy)
                try:
                    await leasing
                except BaseException:
                    await sandbox.guest.destroy(keep_files=True)
                    raise
                return sandbox
            runtime = self.runtime
            stream = runtime.template_stream(manifest)
            return await self.clones.launch(state, manifest, runtime.memory_deltas(manifest), stream, init)
        except BaseException:
            self.layers.remove(top)
            await self._unlease(leasing, manifest.id, holders)
            shutil.rmtree(host.workdir(sandbox_id), ignore_errors=True)
            raise

    async def resume(self, state: SandboxState, init: GuestInit) -> SandboxVM:
        """Continue a paused sandbox from its saved state (or its parked process).

        `SandboxMoved` if another node took it over from the repository (it is gone from here).
        The pause's upload to the repository, if one runs, is not waited for: it is superseded
        (`Handover.supersede`), and the sandbox writes a new layer over the one being uploaded.
        """
        uploading = await self.handover.supersede(state.sandbox_id)
        pause = await self.handover.claim(state)
        try:
            sandbox = await self._resume(state, init, uploading)
        except BaseException:
            await self.handover.unclaim(pause)
            if uploading:  # paused still: commit its pause again, now from its current files
                with contextlib.suppress(OSError, ValueError):
                    self.handover.recover(self.host.load_state(state.sandbox_id))
            raise
        if pause is None and self.handover.enabled:
            # A parked sandbox's pause reached the disk only during the resume, and was committed
            # then: that pause is stale now, and must go as the claimed one would (else a later
            # take-over would continue the sandbox from it, and the next pause not be committed).
            pause = await self.handover.claim(sandbox.state)
        await self.handover.retire(sandbox.state, pause)
        return sandbox

    async def _resume(self, state: SandboxState, init: GuestInit, uploading: bool) -> SandboxVM:
        parked = self.pauses.unpark(state.sandbox_id)
        if parked is not None:
            if uploading:
                await parked.capture  # done before the upload began; the guest is stopped
                await self._new_top(parked.sandbox.state, parked.sandbox)
            return await self.pauses.resume_parked(parked, init)
        if uploading:
            await self._new_top(state, None)
        if state.paused and state.disk_only:
            return await self.reboot(state, init)
        if not state.paused or state.delta is None or state.devices is None:
            raise EngineError(f"sandbox {state.sandbox_id} is not paused")
        manifest = self.repository.leased(state.snapshot_id, state.sandbox_id)
        await self.host.check_runnable(manifest)
        await asyncio.to_thread(self.runtime.prepare, manifest)
        stream = self.host.workdir(state.sandbox_id) / "resume.vmstate"
        prefix = self.runtime.vmstate_prefix(manifest)
        stream.write_bytes(devstate.splice(prefix, Path(state.devices).read_bytes()))
        return await self.clones.launch(state, manifest, [Path(state.delta)], stream, init)

    async def _new_top(self, state: SandboxState, kept: SandboxVM | None) -> None:
        """Give a paused sandbox a new writable layer over its top one, which is sealed: an upload
        of its pause, superseded but maybe still reading that layer, never sees it change.

        `kept`: the sandbox's QEMU process, stopped but kept (parked), which writes the new layer
        from now on; else the layer is made for the QEMU the resume starts.
        """
        layers, below = self.layers, state.disk_layers[-1]
        if kept is None:
            top = await layers.create_upper(below)
        else:
            top = new_layer_id()
            await migration.seal_disk(kept.vm, kept.root_node, layers.path(top), f"n{top}")
            kept.root_node = f"n{top}"
        layers.seal(below)
        state.disk_layers.append(top)
        state.save(self.host.workdir(state.sandbox_id))

    async def reboot(self, state: SandboxState, init: GuestInit) -> SandboxVM:
        """Boot a sandbox paused with its disk only: a new guest on the same disk."""
        manifest = self.repository.leased(state.snapshot_id, state.sandbox_id)
        await self.host.check_runnable(manifest)
        try:
            sandbox = await self._boot(state, manifest, init)
        except BaseException:  # back to where it was: paused with its disk only
            self.pauses.forget_memory(state)
            raise
        state.disk_only = False
        state.save(self.host.workdir(state.sandbox_id))
        return sandbox

    async def _boot(self, state: SandboxState, manifest: SnapshotManifest, init: GuestInit) -> SandboxVM:
        """Boot the sandbox's disk and tell the guest who it is, as a template's guest is told:
        its environment, user and workdir, then its start command until the ready check passes."""
        runtime = manifest.runtime
        init = replace(
            init,
            env_vars={**runtime.env_vars, **init.env_vars},
            default_user=init.default_user or runtime.user,
            default_workdir=init.default_workdir or runtime.workdir,
        )
        sandbox = await self.clones.boot(state, manifest, init, BOOT_TIMEOUT)
        try:
            await start_runtime(sandbox.envd, runtime, BOOT_TIMEOUT)
        except BaseException:
            await sandbox.guest.destroy(keep_files=True)
            raise
        return sandbox

    async def kill(self, sandbox: SandboxVM | SandboxState) -> None:
        """End a running or paused sandbox and free everything it owns."""
        state = sandbox.state if isinstance(sandbox, SandboxVM) else sandbox
        parked = self.pauses.unpark(state.sandbox_id)
        if parked is not None:
            await parked.end_capture()  # its pause is not needed on disk any more
            sandbox, state = parked.sandbox, parked.sandbox.state
        try:
            pause = await self.handover.claim(state)
        except SandboxMoved:  # it lives on elsewhere: only this node's files of it go
            pause = None
        if isinstance(sandbox, SandboxVM):
            await sandbox.guest.destroy(keep_files=True)
        elif not state.paused:  # left running by a crashed node: its VM and namespace are strays
            kill_stray(self.layers, state.pid, state.disk_layers)
            SandboxNetwork(state.network_name).destroy()
        # A paused sandbox has no network: the name it had may belong to another sandbox by now.
        # In a thread, as the directory: under 256 rollouts, unlinking tops on the event loop took
        # 1.9 % of it (py-spy, bench `rollout`).
        await asyncio.to_thread(self.layers.remove, state.disk_layers[-1])
        await asyncio.to_thread(shutil.rmtree, self.host.workdir(state.sandbox_id), ignore_errors=True)
        await self.stop.release(self.repository, state.snapshot_id, state.sandbox_id)
        await self.handover.retire(state, pause)

    async def set_policy(self, sandbox: SandboxVM, policy: EgressPolicy) -> None:
        """Replace a running sandbox's egress rules (one nft transaction) and remember them."""
        await sandbox.guest.network.apply_policy(policy)
        sandbox.state.policy = asdict(policy)
        sandbox.state.save(sandbox.guest.workdir)

    async def snapshot(
        self,
        sandbox: SandboxVM,
        *,
        alias: str | None = None,
        metadata: dict[str, str] | None = None,
        memory: bool = True,
        wait: bool = True,
    ) -> SnapshotManifest:
        """Snapshot a running sandbox; it is stopped only for the capture.

        Without `memory` only the disk is kept (the guest writes its files out first), and
        sandboxes started from the snapshot boot from it. Without `wait` the call returns once
        the capture is on this node's disk, with the manifest marked pending, and the snapshot
        is committed in the background (`aenv.snapshot.pending`); else it returns it committed.

        A snapshot that fails before it is answered leaves nothing: its capture is removed and
        a disk layer it sealed is unsealed (`unseal`), so the sandbox runs on its chain as it
        was. One whose background commit fails is rolled back by `pending` (its files), and
        whoever serializes the sandbox's operations unseals its layer (`SnapshotFailed`).
        """
        self._check_alias_free(alias)
        snapshot_id = new_snapshot_id()
        directory = self.pending.directory(snapshot_id)
        state = sandbox.state
        sealed = state.disk_layers[-1]
        new_top = new_layer_id()
        new_node = f"n{new_top}"
        try:
            if not memory:
                await write_out_files(sandbox)
            async with migration.stopped(sandbox.vm, resume=True):
                if memory:  # neither hashed nor flushed with the guest stopped: `pending` does both
                    await self.clones.capture(sandbox, directory, CAPTURE, sync=False)
                await migration.seal_disk(sandbox.vm, sandbox.root_node, self.layers.path(new_top), new_node)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        sandbox.root_node = new_node
        state.disk_layers.append(new_top)
        try:
            self.layers.seal(sealed)
            state.save(self.host.workdir(state.sandbox_id))
            chain = state.disk_layers[:-1]
            draft = self._snapshot_manifest(snapshot_id, sandbox, memory, chain, alias, metadata)
            if not wait:  # answered before its commit: the other nodes learn it is coming
                await self.pending.announce(draft)
            self.pending.add(draft, directory)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            await self.unseal(sandbox, sealed)
            raise
        if not wait:
            return self.pending.get(snapshot_id) or self.repository.get(snapshot_id)
        await self.pending.committed(snapshot_id)
        return self.repository.get(snapshot_id)

    async def unseal(self, sandbox: SandboxVM, layer: str) -> bool:
        """Undo the seal of disk layer `layer` by a snapshot that failed: what the sandbox wrote
        since moves down into it and it is the sandbox's writable top again, so failed snapshots
        never lengthen its chain. Only while `layer` is right below the running sandbox's top
        (else a later snapshot or pause holds it, and it stays); returns whether it was undone.
        The caller holds the sandbox still (no other operation on it meanwhile).
        """
        state, layers = sandbox.state, self.layers
        if state.paused or state.disk_layers[-2:-1] != [layer] or not sandbox.vm.alive():
            return False
        if layer in state.kept_layers:  # a checkpoint's (a promoted checkpoint failed): it stays
            return False
        top = state.disk_layers[-1]
        try:
            base_node, _ = await migration.unseal_disk(sandbox.vm, sandbox.root_node, layers.path(layer))
        except BaseException:
            layers.seal(layer)  # the chain stays as it was, the layer read-only again
            raise
        sandbox.root_node = base_node
        state.disk_layers.pop()
        state.save(self.host.workdir(state.sandbox_id))
        layers.remove(top)
        return True

    async def promote(
        self,
        sandbox: SandboxVM,
        checkpoint: Checkpoint,
        files: tuple[Path, Path],
        alias: str | None,
        metadata: dict[str, str],
    ) -> SnapshotManifest:
        """A checkpoint of the sandbox as a snapshot, answered pending and committed in the
        background (`pending`). Its files are linked, not copied: neither is ever written again."""
        self._check_alias_free(alias)
        snapshot_id = new_snapshot_id()
        directory = self.pending.directory(snapshot_id)
        try:
            for source, name in zip(files, (DEVICES, DELTA), strict=True):
                os.link(source, directory / name)
            draft = self._snapshot_manifest(
                snapshot_id,
                sandbox,
                True,
                list(checkpoint.disk_layers),
                alias,
                {"sandbox_id": sandbox.sandbox_id},
            )
            source = {**draft.source, "checkpoint_id": checkpoint.checkpoint_id}
            self.pending.add(replace(draft, source=source), directory)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return self.pending.get(snapshot_id) or self.repository.get(snapshot_id)

    def _check_alias_free(self, alias: str | None) -> None:
        """A snapshot answered before its commit must not fail it later for its alias: check now."""
        if alias is None:
            return
        check_alias(alias)
        if alias in self.pending.aliases():
            raise AliasConflict(f"alias {alias!r} already points to a snapshot being committed")
        with contextlib.suppress(SnapshotNotFound):
            target = self.repository.resolve(alias)
            raise AliasConflict(f"alias {alias!r} already points to {target!r}")

    def _snapshot_manifest(
        self,
        snapshot_id: str,
        sandbox: SandboxVM,
        memory: bool,
        layers: list[str],
        alias: str | None,
        metadata: dict[str, str] | None,
    ) -> SnapshotManifest:
        """The manifest to commit, its captured files' digests not filled in yet (`pending` does).

        A disk-only one keeps its origin's memory image and device state only as the machine to boot.
        """
        origin = sandbox.manifest
        return SnapshotManifest(
            id=snapshot_id,
            kind="snapshot",
            alias=alias,
            created_at=utc_now(),
            source={
                "sandbox_id": sandbox.sandbox_id,
                "snapshot_id": origin.id,
                **({"checkpoint_id": sandbox.state.checkpoint} if sandbox.state.checkpoint else {}),
            },
            machine=origin.machine,
            memory_image=origin.memory_image,
            memory_deltas=(),
            device_state=origin.device_state,
            vmstate_prefix=origin.vmstate_prefix,
            disk_layers=tuple(layers),
            runtime=origin.runtime,
            metadata={**(metadata or {}), **({} if memory else {DISK_ONLY: "true"})},
        )

    async def fork(self, sandbox: SandboxVM, children: list[tuple[str, GuestInit]]) -> list[SandboxVM]:
        """Start children from the sandbox's current state; the source keeps running.

        The children share one hidden snapshot, deleted as soon as the last of them is gone. A
        fork that fails leaves the source's disk chain as it was: a failed commit is undone by
        `snapshot`'s caller (`SnapshotFailed`), children that fail to start here.
        """
        sealed = sandbox.state.disk_layers[-1]
        manifest = await self.snapshot(sandbox, metadata={"aenv.fork-of": sandbox.sandbox_id})
        policy = sandbox.state.egress
        results = await asyncio.gather(
            *(self.start(manifest.id, child_id, init, policy) for child_id, init in children),
            return_exceptions=True,
        )
        self.repository.delete(manifest.id, defer=True)
        started = [r for r in results if isinstance(r, SandboxVM)]
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            for child in started:
                await self.kill(child)
            if not self.repository.is_live(manifest.id):  # deleted with its last child
                await self.unseal(sandbox, sealed)
            raise EngineError(f"fork failed: {failures[0]}") from failures[0]
        return started
