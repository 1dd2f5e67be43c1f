"""Warm VMs: what the warm pool keeps, made, handed over to a sandbox, and undone.

A warm VM is a guest restored from a snapshot on its own disk layer and network namespace,
with no identity yet; it holds a lease on its snapshot like a sandbox would. Its directory
(`runtime/warm/<id>/`) has a record naming what it owns, so that a node process that did not
stop cleanly leaves nothing behind: the next one ends it (`aenv.snapshot.recovery`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..network.egress import EgressPolicy
from ..network.netns import SandboxNetwork
from ..repository.contract import Repository
from ..repository.manifest import SnapshotManifest
from ..runtime.contract import RuntimeResolver
from ..runtime.layers import LayerStore
from ..vmm.envd_link import EnvdLink
from ..vmm.machine import VirtualMachine
from .clones import Clones
from .host import Host, StopDeadline
from .model import GuestInit, SandboxState, SandboxVM, clock_payload, replace_text
from .warm_pool import REFRESH_INTERVAL, WarmVM

WARM_FILE = "warm.json"
# What a warm VM runs before it joins the pool, as the snapshot's default user: a command the way
# E2B's SDKs send one (`bash -l -c`), and a file written (then removed) the way they upload one.
REHEARSAL = "true"
REHEARSAL_DATA = b"\n" * 4096
REHEARSAL_TIMEOUT = 60.0
REFRESH_TIMEOUT = 10.0
# How long after its last clock setting a warm VM is handed out without an `/init`: the pool
# refreshes it every REFRESH_INTERVAL, and may be late on a busy host.
CLOCK_FRESH = 3 * REFRESH_INTERVAL

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmRecord:
    """What a warm VM owns, on disk while it lives: its QEMU, disk layer, namespace and lease;
    and whether it is ready (in the pool), which is what an observer such as the bench waits for."""

    pid: int
    snapshot_id: str
    top_layer: str
    network: str
    ready: bool = False

    def save(self, workdir: Path) -> None:
        """Written whole or not at all: a torn record would hide its QEMU from the recovery."""
        replace_text(workdir / WARM_FILE, json.dumps(asdict(self)))

    @staticmethod
    def found(warm_dir: Path) -> Iterator[Path]:
        """The record files under the warm VMs' directory."""
        return warm_dir.glob(f"*/{WARM_FILE}")

    @classmethod
    def load(cls, record: Path) -> WarmRecord:
        return cls(**json.loads(record.read_text()))

    @classmethod
    def ready_count(cls, warm_dir: Path, snapshot_id: str) -> int:
        """How many warm VMs of a snapshot are in the pool, as their records say: for whoever
        watches a node from outside (the bench, tests). One that ends meanwhile is not counted."""
        count = 0
        for record in cls.found(warm_dir):
            with contextlib.suppress(OSError, ValueError, TypeError):
                found = cls.load(record)
                count += found.snapshot_id == snapshot_id and found.ready
        return count


class WarmVMs:
    """Makes and undoes the warm pool's VMs (its `WarmSource`) and turns one into a sandbox."""

    def __init__(
        self,
        host: Host,
        repository: Repository,
        runtime: RuntimeResolver,
        layers: LayerStore,
        stop: StopDeadline,
        clones: Clones,
    ):
        self.host = host
        self.repository, self.runtime, self.layers, self.stop = repository, runtime, layers, stop
        self.clones = clones
        self.directory = host.runtime_dir / "warm"

    async def spawn(self, snapshot_id: str) -> WarmVM:
        """A restored, running guest for the pool that has no sandbox yet.

        Its envd has taken an `/init` that gave its RNG fresh entropy and an access token of its
        own, issued here as a create would (and written down by envd in the pool, not on the way
        to the user's first request); then it ran a command and wrote a file (`rehearse`); then
        its clock was set once more, now that its guest answers in milliseconds (the first
        `/init` of a guest restored in a new QEMU process takes long enough under TCG to leave
        its clock 0.2-0.3 s behind). A create that asks for no variables takes it as it is
        (`claim`).
        """
        host = self.host
        entry_id = "w" + secrets.token_hex(6)
        manifest = self.repository.acquire(snapshot_id, entry_id)
        workdir = self.directory / entry_id
        top: str | None = None
        network: SandboxNetwork | None = None
        vm: VirtualMachine | None = None
        try:
            await host.check_runnable(manifest)
            top = await self.clones.new_top_layer(manifest)
            network = await host.network(f"aenv-{entry_id}", None)
            vm = await self.clones.spawn(manifest, top, workdir, network)
            # Recorded as soon as its process exists: a node that dies while the guest is still
            # being restored leaves a record for the next one to end it by (`cleanup_warm_leftovers`).
            record = WarmRecord(vm.pid, manifest.id, top, network.name)
            record.save(workdir)
            runtime = self.runtime
            await self.clones.load(
                vm, manifest, runtime.memory_deltas(manifest), runtime.template_stream(manifest)
            )
            token = secrets.token_hex(32)
            envd = EnvdLink(network, token)
            await envd.init(GuestInit(access_token=token).payload(), timeout=60)
            # On connections of its own: envd answers the node's `/init` on a fast path until a
            # connection carries anything else, which then goes to aiohttp for good.
            rehearsal = EnvdLink(network, token)
            try:
                await rehearse(rehearsal)
            finally:
                rehearsal.close()
            await envd.init(clock_payload(), timeout=REFRESH_TIMEOUT)
            runtime.restored(manifest)
            replace(record, ready=True).save(workdir)
        except BaseException:
            if vm is not None:
                await vm.kill()
            if network is not None:
                network.destroy()
            if top is not None:
                self.layers.remove(top)
            shutil.rmtree(workdir, ignore_errors=True)
            await self.stop.release(self.repository, snapshot_id, entry_id)  # cancelled by a stop, too
            raise
        return WarmVM(entry_id, manifest.id, vm, network, envd, top, workdir, token)

    async def refresh(self, warm: WarmVM) -> None:
        """Set a waiting warm VM's clock again (`WarmPool` calls this every `REFRESH_INTERVAL`)."""
        await warm.envd.init(clock_payload(), timeout=REFRESH_TIMEOUT)

    async def discard(self, warm: WarmVM) -> None:
        """End a warm VM and free everything it owns."""
        warm.envd.close()
        await warm.vm.kill()
        await warm.network.aclose()
        self.layers.remove(warm.top_layer)
        await asyncio.to_thread(shutil.rmtree, warm.workdir, ignore_errors=True)
        await self.stop.release(self.repository, warm.snapshot_id, warm.entry_id)

    async def claim(
        self,
        warm: WarmVM,
        state: SandboxState,
        manifest: SnapshotManifest,
        init: GuestInit,
        policy: EgressPolicy,
    ) -> SandboxVM:
        """Make the warm VM the sandbox `state` describes: its directory, egress and `/init`.

        A secured sandbox that asks for no variables, of a warm VM whose clock was set within
        `CLOCK_FRESH`, needs no `/init`: it takes the token the warm VM holds (issued by this node
        as a create's would be, and never seen by anyone) instead of `init`'s, and the returned
        sandbox's `guest.envd.access_token` says so. This saves the create a round trip into a
        guest that has been idle (4-12 ms measured under TCG, against 45 ms for a whole restore).
        The caller swaps the warm VM's lease on the snapshot for the sandbox's (`Lifecycle.start`).
        """
        workdir = self.host.workdir(state.sandbox_id)
        (warm.workdir / WARM_FILE).unlink(missing_ok=True)
        warm.workdir.rename(workdir)
        warm.vm.workdir = workdir
        if warm.network.policy != policy and self.host.networks is not None:
            await warm.network.apply_policy(policy)
        if adoptable(warm, init):
            return self.clones.record(state, manifest, warm.vm, warm.network, warm.envd)
        # reseeded when it was spawned (`spawn`)
        return await self.clones.identify(
            state, manifest, warm.vm, warm.network, init, warm.envd, reseed=False
        )


def adoptable(warm: WarmVM, init: GuestInit) -> bool:
    """Whether the warm VM's guest is already what `init` asks for, but for the token's value."""
    return (
        init.access_token is not None
        and warm.token is not None
        and not init.env_vars
        and init.default_user is None
        and init.default_workdir is None
        and time.monotonic() - warm.refreshed <= CLOCK_FRESH
    )


async def rehearse(envd: EnvdLink) -> None:
    """Run a command and write a file the way a user's first ones run, so that each has run once
    in this process.

    Under TCG a guest restored in a new QEMU process translates every code path afresh the first
    time it takes it: envd's routes, the kernel's fork, exec and file writes, the loader, bash and
    the login profile. A user's first command after a create paid that, 0.6-0.8 s on a 2-core host
    against 50-80 ms for the next one, and a first upload 150-210 ms against about 60; the pool
    pays it instead, before the sandbox exists. The cost is memory that the user's first calls
    would take anyway: measured under TCG, a warm VM's QEMU keeps 27 MiB more of translated code
    and 5 MiB more of its own bookkeeping, and its guest 7 MiB more of written pages (mostly the
    page cache of what the command read, the same in every sandbox). Under KVM only the guest's
    pages remain, and both calls take milliseconds.

    The file goes to a fresh name in /tmp and is removed by a second command, so the sandbox
    finds nothing of it; a guest that cannot remove it is not handed out (the error ends the
    spawn). A template whose image lacks bash or its default user cannot run the command: envd
    refuses, or the command fails, and the rehearsal stops there, with the warm VM usable.
    """
    try:
        if await envd.run(REHEARSAL, user=None, timeout=REHEARSAL_TIMEOUT) != 0:
            return
    except RuntimeError as exc:
        log.debug("the warm VM's first command was refused: %s", exc)
        return
    path = f"/tmp/.aenv-rehearsal-{secrets.token_hex(8)}"
    try:
        await envd.write_file(path, REHEARSAL_DATA, user=None, form=True, timeout=REHEARSAL_TIMEOUT)
    except RuntimeError as exc:  # e.g. a /tmp the user cannot write to
        log.debug("the warm VM's first upload was refused: %s", exc)
    if await envd.run(f"rm -f {path}", user=None, timeout=REHEARSAL_TIMEOUT) != 0:
        raise RuntimeError(f"the warm VM could not remove its rehearsal file {path}")
