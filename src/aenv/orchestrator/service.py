"""The sandbox lifecycle: one state machine per sandbox, TTLs, and persistence across restarts.

Operations on one sandbox are serialized by its lock and go through the transition table of
`states.py`, so its state shows what is happening meanwhile and the API reports it truthfully.
Running sandboxes are paused (or killed, by configuration) when the node stops; after a crash,
VMs that outlived the node are adopted and paused, so a restart loses nothing silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from http.client import HTTPException
from typing import TYPE_CHECKING, Any

from .. import clock, logs
from ..agent.envd import ENVD_VERSION
from ..clock import rfc3339
from ..config import Settings
from ..network.egress import EgressPolicy
from ..network.netns import SandboxNetwork
from ..snapshot.checkpoints import Checkpoint, CheckpointConflict, CheckpointNotFound, InvalidCheckpoint
from ..snapshot.engine import EngineError, GuestInit, SandboxVM, SnapshotEngine
from ..snapshot.handover import PauseReclaimed, SandboxMoved
from ..snapshot.manifest import SnapshotManifest
from ..snapshot.pending import SnapshotPending
from ..snapshot.repository import (
    AliasConflict,
    InvalidName,
    RepositoryError,
    SnapshotExists,
    SnapshotNotFound,
)
from ..vmm.envd_link import EnvdUnavailable, GuestAnswerError, SampleBatch
from .admission import Admission, meminfo_mib
from .errors import (
    NOT_SHARED,
    PAUSE_GONE,
    SNAPSHOT_PENDING,
    BadGuest,
    Conflict,
    InvalidRequest,
    NotFound,
    OperationFailed,
    SandboxError,
    Unavailable,
)
from .interface import CreateRequest
from .metrics import MetricsArchive, SampleWatch, between, merge, sandbox_metric
from .reclaim import MemoryReclaimer
from .states import Op, State, Transition, transition
from .store import SandboxRecord, SandboxStore

if TYPE_CHECKING:
    from ..volumes.mounts import SandboxVolumes

log = logging.getLogger(__name__)

DISK_SIZE_MB = 4096
AUTO_RESUME_MIN_TIMEOUT = 300
# The cluster-wide metrics view asks each guest for this much of its history, not all of it.
RECENT_SECONDS = 60
# Metadata of a snapshot taken while its sandbox had volumes mounted (its guest holds the mounts).
VOLUMES_MARK = "aenv.volumes"
LOST_KEPT = 1000  # how many lost sandboxes the node still explains (404 with the reason)
# What the engine raises when an operation fails for a reason outside this process's code: QEMU,
# QMP, envd, networking, the disk or a damaged saved state. Anything else is a bug, left to the
# API's error boundary (logged with its traceback, answered as an internal error).
ENGINE_FAILURES = (RuntimeError, OSError, ValueError, RepositoryError)
# A pause snapshot's metadata: the sandbox's record, for the node that takes the sandbox over.
SANDBOX_RECORD = "aenv.sandbox-record"
MOVED_CHECK_SECONDS = 30.0  # how often durably paused sandboxes are checked for a take-over elsewhere


def _parse(value: str) -> datetime:
    return datetime.fromisoformat(value)


def egress_policy(allow_internet: bool | None, network: dict[str, Any]) -> EgressPolicy:
    """The E2B network fields as a policy; 400 for what it cannot express (domain names)."""
    try:
        return EgressPolicy(
            allow_internet=allow_internet is not False,
            allow_out=tuple(network.get("allowOut") or ()),
            deny_out=tuple(network.get("denyOut") or ()),
        )
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


def _exit_reason(code: int) -> str:
    """A QEMU exit status in words; -1: an adopted process, whose status only its parent saw."""
    if code == -1:
        return "status unknown"
    return f"killed by signal {-code}" if code < 0 else f"exit status {code}"


def catalog_name(reference: str) -> str:
    """A template or snapshot reference as E2B spells it (`namespace/name:tag`) reduced to its name."""
    return reference.rsplit("/", 1)[-1].split(":", 1)[0]


SANDBOX_ID = re.compile(r"i[a-z0-9]{20}")


ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


def new_sandbox_id() -> str:
    """`i` + 20 characters of [a-z0-9], as E2B's: no dashes or dots, which would break host routing.

    Drawn from one 128-bit random number (one getrandom call, not one per character: a create
    through a gateway makes an id, and twenty calls cost it 0.2 ms under load)."""
    return sandbox_id_of(int.from_bytes(secrets.token_bytes(16)))


def sandbox_id_of(value: int) -> str:
    """A sandbox id made of a 128-bit number (random, or a digest: `fanout.member_id`)."""
    characters = []
    for _ in range(20):
        value, digit = divmod(value, len(ID_ALPHABET))
        characters.append(ID_ALPHABET[digit])
    return "i" + "".join(characters)


def chosen_id(request: CreateRequest) -> str:
    """The id a create asked for (a gateway's, of `new_sandbox_id`'s form), else a new one."""
    if request.sandbox_id is None:
        return new_sandbox_id()
    if not SANDBOX_ID.fullmatch(request.sandbox_id):
        raise InvalidRequest(f"a sandbox id is i and 20 of [a-z0-9], not {request.sandbox_id[:64]!r}")
    return request.sandbox_id


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


class Orchestrator:
    """Owns every sandbox on this node."""

    def __init__(
        self,
        settings: Settings,
        engine: SnapshotEngine,
        store: SandboxStore,
        volumes: SandboxVolumes | None = None,
    ):
        self.settings = settings
        self.engine = engine
        self.store = store
        self.volumes = volumes  # None: the node has no volumes (creates that mount one get 400)
        self.sandboxes: dict[str, Sandbox] = {}
        self.counters = {"create_successes": 0, "create_failures": 0, "lost": 0}
        self.reclaimer = MemoryReclaimer(
            self.sandboxes.values, settings.reclaim_interval, settings.reclaim_growth_mib,
            settings.reclaim_pressure_mib,
        )  # fmt: skip
        self.admission = Admission(
            home=settings.home_path,
            disk_reserve_mib=settings.disk_reserve_mib,
            memory_budget_mib=int(meminfo_mib() * settings.memory_overcommit),
            committed_mib=lambda: sum(s.record.memory_mb for s in self.sandboxes.values() if s.vm),
            free_slots=lambda: None if engine.networks is None else engine.networks.available,
            held_mib=self.reclaimer.held_mib,
            memory_reserve_mib=settings.memory_reserve_mib,
        )
        # Sandboxes whose VM died under them, newest last: a lookup says why they are gone.
        self.lost: dict[str, str] = {}
        self._watchers: dict[int, asyncio.Task[None]] = {}  # by id() of the SandboxVM they watch
        self._evictor: asyncio.Task[None] | None = None
        self._closing = False
        # Called with a sandbox id when its VM stops (pause, kill): the proxy drops its connections.
        self.on_stopped: Callable[[str], None] = lambda sandbox_id: None
        # Called with a sandbox id when its state settles or it is gone: a node in a cluster tells
        # the scheduler where its sandboxes are (aenv.cluster.membership). Must not block.
        self.on_changed: Callable[[str], None] = lambda sandbox_id: None
        engine.handover.describe = self._describe
        engine.handover.on_durable = self._durable
        engine.pending.on_failed = self._snapshot_failed
        self._unseals: set[asyncio.Task[None]] = set()

    # -- state transitions -----------------------------------------------------------------

    def _transition(self, sandbox: Sandbox, op: Op) -> contextlib.AbstractContextManager[Transition]:
        """One operation's state change (`states.transition`); the caller holds the sandbox's lock."""
        if sandbox.id not in self.sandboxes:
            raise NotFound(f"sandbox {sandbox.id} not found")
        return transition(sandbox.record, op, self._persist)

    def _persist(self, record: SandboxRecord) -> None:
        self.store.put(record)
        self.on_changed(record.sandbox_id)

    @contextlib.asynccontextmanager
    async def _operation(self, sandbox: Sandbox, op: Op) -> AsyncIterator[Transition]:
        """Take the sandbox's lock, then run `op`'s state change around the caller's work."""
        async with sandbox.lock:
            with self._transition(sandbox, op) as rule:
                yield rule

    # -- startup and shutdown --------------------------------------------------------------

    def surviving_networks(self) -> list[str]:
        """Namespaces of sandboxes a previous node process may have left running."""
        names = []
        for record in self.store.all():
            if record.state != State.PAUSED:
                with contextlib.suppress(OSError, ValueError):
                    names.append(self.engine.load_state(record.sandbox_id).network_name)
        return names

    async def start(self, networks: dict[str, SandboxNetwork] | None = None) -> None:
        """Load sandboxes from the store, recover what a crash left running, start the evictor.

        `networks` are the namespaces the network pool kept for `surviving_networks()`.
        """
        for record in self.store.all():
            sandbox = Sandbox(record)
            self.sandboxes[record.sandbox_id] = sandbox
            async with sandbox.lock:
                if record.state != State.PAUSED:
                    await self._recover(sandbox, networks or {})
                else:
                    await self._settle(sandbox)
        if killed := self.engine.kill_unclaimed_vms(self._claimed_pids()):
            log.warning("ended the VMs of creates the previous node process did not finish: pids %s", killed)
        self._evictor = asyncio.create_task(self._evict_forever())
        self.reclaimer.start()

    def vm_pids(self) -> set[int]:
        """The QEMU processes of the sandboxes whose VM this node holds: running, or kept while
        paused (parked)."""
        running = {s.vm.guest.vm.pid for s in self.sandboxes.values() if s.vm is not None}
        return running | self.engine.parked.pids()

    def _claimed_pids(self) -> set[int]:
        """The QEMU processes the recovered sandboxes own (running, or parked while paused)."""
        claimed = self.vm_pids()
        for sandbox_id in self.sandboxes:
            with contextlib.suppress(OSError, ValueError):
                if (pid := self.engine.load_state(sandbox_id).pid) is not None:
                    claimed.add(pid)
        return claimed

    async def _recover(self, sandbox: Sandbox, networks: dict[str, SandboxNetwork]) -> None:
        """A sandbox the previous node process left in a running or transitional state."""
        record = sandbox.record
        try:
            state = self.engine.load_state(record.sandbox_id)
        except OSError:
            log.error(
                "sandbox %s was %s but has no saved state: removing it", record.sandbox_id, record.state
            )
            self._forget(sandbox)
            return
        if state.paused:
            with self._transition(sandbox, Op.RECOVER_PAUSED):
                self._stopped(sandbox)
            await self._settle(sandbox)
            return
        try:
            with self._transition(sandbox, Op.ADOPT):
                network = networks.get(state.network_name)
                self._attach(sandbox, await self.engine.adopt(state, record.envd_token, network))
            await self._pause_locked(sandbox)
            log.info("sandbox %s outlived the node process and was paused", record.sandbox_id)
        except (*ENGINE_FAILURES, SandboxError) as exc:
            log.error("sandbox %s was lost with the previous node process: %s", record.sandbox_id, exc)
            network = networks.get(state.network_name)
            if network is not None:
                network.destroy()  # the pool's own object, so its slot is freed
            # Best effort on a VM that is already lost: whatever fails here, the record goes.
            with contextlib.suppress(Exception):
                await self.engine.kill(state)
            self._forget(sandbox)

    async def _settle(self, sandbox: Sandbox) -> None:
        """A paused sandbox whose process the previous node process kept: save it, end the process."""
        try:
            state = self.engine.load_state(sandbox.id)
            await self.engine.settle_paused(state)
            if moved_to := await asyncio.to_thread(self.engine.handover.moved, state):
                raise SandboxMoved(sandbox.id, moved_to)
            sandbox.record.durable = state.durable is not None
            self.engine.handover.recover(state)  # a pause not yet committed is committed now
        except SandboxMoved as exc:
            log.info("paused sandbox %s is gone: %s", sandbox.id, exc)
            self._lose(sandbox.id, f"it was taken over by node {exc.node}")
            with contextlib.suppress(Exception):
                await self.engine.kill(self.engine.load_state(sandbox.id))
            self._forget(sandbox)
        except (EngineError, OSError, LookupError) as exc:
            log.error("paused sandbox %s was lost with the previous node process: %s", sandbox.id, exc)
            # Best effort on a sandbox that is already lost: whatever fails here, the record goes.
            with contextlib.suppress(Exception):
                await self.engine.kill(self.engine.load_state(sandbox.id))
            self._forget(sandbox)

    async def close(self) -> None:
        """Pause (or kill, by configuration) every running sandbox, then stop."""
        self._closing = True
        await self.reclaimer.stop()
        if self._evictor is not None:
            self._evictor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._evictor
        await self.engine.close()
        for watcher in list(self._watchers.values()):
            watcher.cancel()
        for sandbox in list(self.sandboxes.values()):
            async with sandbox.lock:
                if sandbox.vm is None:
                    continue
                try:
                    if self.settings.shutdown_action == "pause":
                        await self._pause_locked(sandbox)
                    else:
                        await self._kill_locked(sandbox)
                except SandboxError as exc:
                    log.error("stopping sandbox %s failed: %s", sandbox.id, exc.message)
        if self.volumes is not None:
            await self.volumes.close()
        await self.engine.handover.close()  # the pauses just made become durable before the exit
        self.store.close()

    # -- lookups ---------------------------------------------------------------------------

    def get(self, sandbox_id: str) -> Sandbox:
        sandbox = self.sandboxes.get(sandbox_id.split("-", 1)[0])
        if sandbox is None or sandbox.record.state == State.KILLING:
            if reason := self.lost.get(sandbox_id.split("-", 1)[0]):
                raise NotFound(f"sandbox {sandbox_id} was lost: {reason}")
            raise NotFound(f"Sandbox \"{sandbox_id}\" doesn't exist or you don't have access to it")
        return sandbox

    def volume_users(self, name: str) -> list[str]:
        """The sandboxes (running or paused) that mount the volume named `name`."""
        return [
            s.id for s in self.sandboxes.values() if any(m["name"] == name for m in s.record.volume_mounts)
        ]

    async def resolve_template(self, reference: str) -> SnapshotManifest:
        """A template or snapshot by id or alias; `namespace/` prefixes and `:tag` suffixes are ignored."""
        if (pending := self.engine.pending.get(catalog_name(reference))) is not None:
            return pending  # this node's, being committed: a start waits for the commit
        try:
            return self.engine.repository.get(catalog_name(reference))
        except (SnapshotNotFound, RepositoryError):
            if (found := await self.committed_elsewhere(catalog_name(reference))) is not None:
                return found
            failure = self.engine.pending.failure(catalog_name(reference))
            raise NotFound(failure or f"template '{reference}' not found") from None

    async def committed_elsewhere(self, name: str) -> SnapshotManifest | None:
        """A snapshot another node answered, once committed (`PendingSnapshots.elsewhere`); None
        if no node is committing it."""
        try:
            return await self.engine.pending.elsewhere(name, self.settings.pending_wait)
        except SnapshotPending as exc:
            raise Unavailable(str(exc), SNAPSHOT_PENDING) from None
        except SnapshotNotFound as exc:  # its commit failed: why
            raise NotFound(str(exc)) from None

    # -- create ----------------------------------------------------------------------------

    async def create(self, request: CreateRequest) -> Sandbox:
        manifest = await self.resolve_template(request.template)
        policy = egress_policy(request.allow_internet, request.network)
        timeout = self.settings.default_timeout if request.timeout is None else request.timeout
        self._check_timeout(timeout)
        self._check_volumes(request.volume_mounts)
        sandbox_id = chosen_id(request)
        if sandbox_id in self.sandboxes:
            raise Conflict(f"sandbox {sandbox_id} exists already")
        # A warm VM of the template has its network already.
        networks = 0 if self.engine.pool.ready(manifest.id) else 1
        self.admission.check_start("create a sandbox", manifest.machine.memory_mib, networks)
        now = clock.now()
        record = SandboxRecord(
            sandbox_id=sandbox_id,
            template_id=manifest.id,
            alias=manifest.alias,
            state=State.CREATING,
            created_at=rfc3339(now),
            started_at=rfc3339(now),
            end_at=rfc3339(now + timedelta(seconds=timeout)),
            timeout=timeout,
            auto_pause=request.auto_pause,
            auto_pause_memory=request.auto_pause_memory,
            auto_resume=request.auto_resume,
            cpu_count=manifest.machine.vcpus,
            memory_mb=manifest.machine.memory_mib,
            disk_size_mb=DISK_SIZE_MB,
            envd_version=ENVD_VERSION,
            secure=request.secure,
            envd_token=secrets.token_hex(32) if request.secure else None,
            traffic_token=secrets.token_hex(32)
            if request.network.get("allowPublicTraffic") is False
            else None,
            allow_internet=request.allow_internet,
            network=request.network,
            metadata=request.metadata,
            env_vars=request.env_vars,
            volume_mounts=request.volume_mounts,
        )
        sandbox = Sandbox(record)
        self.sandboxes[record.sandbox_id] = sandbox
        async with sandbox.lock:
            self.store.put(record)
            try:
                with self._transition(sandbox, Op.START):
                    init = self._guest_init(record)
                    vm = await self.engine.start(manifest.id, record.sandbox_id, init, policy)
                    # A warm VM's guest may keep the token it was given in the pool (`WarmVMs.claim`).
                    record.envd_token = vm.guest.envd.access_token
                    self._attach(sandbox, vm)
                    try:
                        await self._mount_volumes(sandbox, stale=VOLUMES_MARK in manifest.metadata)
                    except BaseException:
                        await self._kill_vm(sandbox)
                        raise
                    self._set_end(sandbox, timeout)
            except Exception as exc:  # any failure to start: the sandbox never existed
                self.counters["create_failures"] += 1
                self._forget(sandbox)
                log.exception("creating sandbox %s from %s failed", record.sandbox_id, manifest.id)
                raise _start_failure(exc) from exc
        self.counters["create_successes"] += 1
        return sandbox

    def _check_volumes(self, mounts: list[dict[str, str]]) -> None:
        """400 for a mount of a volume that does not exist: never started without it."""
        if not mounts:
            return
        if self.volumes is None:
            raise InvalidRequest("this node has no volumes")
        self.volumes.resolve(mounts)

    async def _mount_volumes(self, sandbox: Sandbox, *, stale: bool = False) -> None:
        """Serve the sandbox's volumes into its namespace and mount them in its running guest.

        `stale`: its guest comes from a snapshot of a sandbox with volumes, whose mounts it holds
        and must let go of even if it mounts none itself.
        """
        wanted = sandbox.record.volume_mounts
        if (wanted or stale) and self.volumes is not None and sandbox.vm is not None:
            await self.volumes.attach(sandbox.vm, wanted)

    async def _unmount_volumes(self, sandbox: Sandbox) -> None:
        """The sandbox's VM stopped (pause, kill): its volume server goes too."""
        if self.volumes is not None:
            await self.volumes.detach(sandbox.id)

    async def _kill_vm(self, sandbox: Sandbox) -> None:
        """End a VM that started but cannot be handed out (its volumes failed); the caller forgets it."""
        vm, sandbox.vm = sandbox.vm, None
        await self._unmount_volumes(sandbox)
        if vm is not None:
            with contextlib.suppress(*ENGINE_FAILURES):
                await self.engine.kill(vm)

    def _check_timeout(self, timeout: int) -> None:
        if timeout > self.settings.max_timeout:
            raise InvalidRequest(f"timeout must be at most {self.settings.max_timeout} seconds")

    def _guest_init(self, record: SandboxRecord) -> GuestInit:
        return GuestInit(env_vars=record.env_vars, access_token=record.envd_token)

    def _set_end(self, sandbox: Sandbox, timeout: int) -> None:
        sandbox.record.paused_at = None
        sandbox.record.end_at = rfc3339(clock.now() + timedelta(seconds=timeout))

    def _stopped(self, sandbox: Sandbox) -> None:
        """The sandbox's VM is gone (paused): drop its connections and its handle."""
        sandbox.samples.stopped(time.monotonic())
        self.on_stopped(sandbox.id)
        sandbox.vm = None
        sandbox.record.paused_at = sandbox.record.paused_at or rfc3339(clock.now())

    def _forget(self, sandbox: Sandbox) -> None:
        self.sandboxes.pop(sandbox.id, None)
        self.store.delete(sandbox.id)
        self.on_changed(sandbox.id)

    def _lose(self, sandbox_id: str, reason: str) -> None:
        """Remember why a sandbox is gone, so a lookup answers 404 with the reason."""
        self.lost[sandbox_id] = reason
        while len(self.lost) > LOST_KEPT:
            self.lost.pop(next(iter(self.lost)))

    # -- VM processes that die -------------------------------------------------------------

    def _attach(self, sandbox: Sandbox, vm: SandboxVM) -> None:
        """Give the sandbox its running VM, and watch that VM's process for an unplanned exit."""
        sandbox.vm = vm
        sandbox.samples.running(time.monotonic())
        if id(vm) in self._watchers:  # a parked VM resumed: its process is watched already
            return
        watcher = asyncio.create_task(self._watch(sandbox, vm), name=f"watch-{sandbox.id}")
        self._watchers[id(vm)] = watcher
        watcher.add_done_callback(lambda _: self._watchers.pop(id(vm), None))

    async def _watch(self, sandbox: Sandbox, vm: SandboxVM) -> None:
        """Wait for the VM's QEMU to exit; if the node did not end it, the sandbox is lost.

        A pause or kill ends QEMU while holding the sandbox's lock and then drops the handle, so
        a handle still in place after the lock is ours again means nobody asked for the exit
        (kill -9, a crash, the host's OOM killer): free what the sandbox held and say so.
        """
        code = await vm.vm.wait()
        async with sandbox.lock:
            if sandbox.vm is not vm or sandbox.id not in self.sandboxes:
                return
            exited = _exit_reason(code)
            reason = f"its VM process {vm.vm.pid} exited unexpectedly ({exited}) at {rfc3339(clock.now())}"
            log.error("sandbox %s was lost: %s", sandbox.id, reason)
            self.counters["lost"] += 1
            self._lose(sandbox.id, reason)
            try:
                await self._kill_locked(sandbox)
            except ENGINE_FAILURES as exc:  # the record is gone either way; leftovers are for GC
                log.error("cleaning up lost sandbox %s failed: %s", sandbox.id, exc)

    # -- operations ------------------------------------------------------------------------

    async def pause(self, sandbox: Sandbox, *, memory: bool = True) -> None:
        """Pause the sandbox; without `memory` only its disk is kept and its resume boots afresh."""
        self.admission.check_disk(f"pause sandbox {sandbox.id}")
        async with sandbox.lock:
            await self._pause_locked(sandbox, memory=memory)

    async def _pause_locked(self, sandbox: Sandbox, *, memory: bool = True) -> None:
        with self._transition(sandbox, Op.PAUSE):
            assert sandbox.vm is not None
            await self._save_samples(sandbox)
            try:
                await self.engine.pause(sandbox.vm, memory=memory)
            except ENGINE_FAILURES as exc:
                raise OperationFailed(f"pausing sandbox {sandbox.id} failed: {exc}") from exc
            sandbox.record.paused_at = rfc3339(clock.now())
            self._stopped(sandbox)
            await self._unmount_volumes(sandbox)

    async def connect(self, sandbox: Sandbox, timeout: int | None, *, memory: bool = True) -> bool:
        """Resume a paused sandbox or extend a running one's TTL; returns whether it resumed.

        Without `memory` a paused sandbox boots afresh from its disk, whatever its pause kept.
        """
        timeout = self.settings.default_timeout if timeout is None else timeout
        self._check_timeout(timeout)
        async with sandbox.lock:
            if sandbox.record.state == State.RUNNING:
                with self._transition(sandbox, Op.EXTEND):
                    self._extend(sandbox, timeout)
                return False
            await self._forget_memory(sandbox, memory)
            await self._resume_locked(sandbox, timeout)
            return True

    async def resume(self, sandbox: Sandbox, timeout: int | None, *, memory: bool = True) -> None:
        """Resume a paused sandbox (409 if it runs: the legacy `/resume` route's contract)."""
        timeout = self.settings.default_timeout if timeout is None else timeout
        self._check_timeout(timeout)
        async with sandbox.lock:
            await self._forget_memory(sandbox, memory)
            await self._resume_locked(sandbox, timeout)

    async def _forget_memory(self, sandbox: Sandbox, memory: bool) -> None:
        """A resume asked to ignore the pause's memory: make it boot from the disk (lock held)."""
        if memory or sandbox.record.state != State.PAUSED:
            return
        try:
            await self.engine.drop_memory(sandbox.id)
        except ENGINE_FAILURES as exc:
            raise OperationFailed(f"resuming sandbox {sandbox.id} from its disk failed: {exc}") from exc

    async def _resume_locked(self, sandbox: Sandbox, timeout: int) -> None:
        record = sandbox.record
        with self._transition(sandbox, Op.RESUME):
            self.admission.check_start(f"resume sandbox {record.sandbox_id}", record.memory_mb)
            try:
                state = self.engine.load_state(record.sandbox_id)
                if state.disk_only:  # a new guest boots, whose samples start afresh
                    sandbox.samples.reset()
                sandbox.samples.running(time.monotonic())  # before its `cont`
                self._attach(sandbox, await self.engine.resume(state, self._guest_init(record)))
            except SandboxMoved as exc:
                raise await self._moved(sandbox, exc) from exc
            except GuestAnswerError as exc:  # its own guest's doing: it stays paused
                log.warning("resuming sandbox %s failed: %s", record.sandbox_id, exc)
                raise BadGuest(f"resuming sandbox {record.sandbox_id} failed: {exc}", exc.code) from exc
            except ENGINE_FAILURES as exc:
                log.exception("resuming sandbox %s failed", record.sandbox_id)
                raise OperationFailed(f"resuming sandbox {record.sandbox_id} failed: {exc}") from exc
            try:
                await self._mount_volumes(sandbox)
            except ENGINE_FAILURES as exc:  # paused again, so that the state reported is the truth
                log.exception("mounting the volumes of resumed sandbox %s failed", record.sandbox_id)
                await self._pause_again(sandbox)
                raise OperationFailed(
                    f"mounting the volumes of sandbox {record.sandbox_id} failed: {exc}"
                ) from exc
            self._set_end(sandbox, timeout)
            record.durable = False

    async def _pause_again(self, sandbox: Sandbox) -> None:
        """Undo a resume whose volumes could not be mounted (the guest has not run user work)."""
        assert sandbox.vm is not None
        try:
            await self.engine.pause(sandbox.vm)
        except ENGINE_FAILURES:
            log.exception("pausing sandbox %s again failed: killing its VM", sandbox.id)
            await self.engine.kill(sandbox.vm)
        self._stopped(sandbox)
        await self._unmount_volumes(sandbox)

    def _extend(self, sandbox: Sandbox, timeout: int) -> None:
        """Move the end time later, never earlier (connect and refreshes)."""
        wanted = clock.now() + timedelta(seconds=timeout)
        if wanted > _parse(sandbox.record.end_at):
            sandbox.record.end_at = rfc3339(wanted)

    async def set_timeout(self, sandbox: Sandbox, timeout: int) -> None:
        self._check_timeout(timeout)
        async with self._operation(sandbox, Op.EXTEND):
            sandbox.record.end_at = rfc3339(clock.now() + timedelta(seconds=timeout))

    async def refresh(self, sandbox: Sandbox, duration: int | None) -> None:
        async with self._operation(sandbox, Op.EXTEND):
            self._extend(sandbox, self.settings.default_timeout if duration is None else duration)

    async def kill(self, sandbox: Sandbox) -> None:
        async with sandbox.lock:
            await self._kill_locked(sandbox)

    async def _kill_locked(self, sandbox: Sandbox) -> None:
        with self._transition(sandbox, Op.KILL):
            try:
                if sandbox.vm is not None:
                    await self.engine.kill(sandbox.vm)
                else:
                    with contextlib.suppress(OSError):
                        await self.engine.kill(self.engine.load_state(sandbox.id))
            finally:
                self.on_stopped(sandbox.id)
                sandbox.vm = None
                self._forget(sandbox)
                await self._unmount_volumes(sandbox)

    async def snapshot(self, sandbox: Sandbox, name: str | None, *, memory: bool = True) -> SnapshotManifest:
        """Snapshot the running sandbox; without `memory` only its disk (sandboxes from it boot)."""
        self.admission.check_disk(f"snapshot sandbox {sandbox.id}")
        async with self._operation(sandbox, Op.SNAPSHOT):
            assert sandbox.vm is not None
            metadata = self._snapshot_metadata(sandbox)
            with engine_errors(f"snapshot of sandbox {sandbox.id}"):
                # Answered once captured on this node; committed in the background (`snapshot.pending`).
                return await self.engine.snapshot(
                    sandbox.vm, alias=name, metadata=metadata, memory=memory, wait=False
                )

    # -- checkpoints and reset (`aenv.snapshot.checkpoints`) ---------------------------------

    async def checkpoint(self, sandbox: Sandbox, name: str | None) -> Checkpoint:
        """Checkpoint the running sandbox; 409 while it is paused (resume it first)."""
        self.admission.check_disk(f"checkpoint sandbox {sandbox.id}")
        async with self._operation(sandbox, Op.CHECKPOINT):
            assert sandbox.vm is not None
            with engine_errors(f"checkpoint of sandbox {sandbox.id}"):
                return await self.engine.checkpoint(sandbox.vm, name)

    def checkpoints(self, sandbox: Sandbox) -> list[Checkpoint]:
        return self.engine.checkpoints.list(sandbox.id)

    async def delete_checkpoint(self, sandbox: Sandbox, checkpoint: str) -> None:
        async with sandbox.lock:
            with engine_errors(f"deleting a checkpoint of sandbox {sandbox.id}"):
                state = sandbox.vm.state if sandbox.vm is not None else None
                self.engine.checkpoints.delete(sandbox.id, checkpoint, state)

    async def promote_checkpoint(
        self, sandbox: Sandbox, checkpoint: str, name: str | None
    ) -> SnapshotManifest:
        """A checkpoint of the running sandbox as a snapshot (as `snapshot` answers one)."""
        self.admission.check_disk(f"snapshot a checkpoint of sandbox {sandbox.id}")
        async with self._operation(sandbox, Op.SNAPSHOT):
            assert sandbox.vm is not None
            with engine_errors(f"snapshot of a checkpoint of sandbox {sandbox.id}"):
                metadata = self._snapshot_metadata(sandbox)
                return await self.engine.promote(sandbox.vm, checkpoint, name, metadata)

    async def reset(self, sandbox: Sandbox, checkpoint: str) -> None:
        """Restore the running sandbox to a checkpoint in a new VM; a reset that fails leaves it
        running as it was."""
        async with self._operation(sandbox, Op.RESET):
            assert sandbox.vm is not None
            with engine_errors(f"resetting sandbox {sandbox.id}"):
                vm = await self.engine.reset(sandbox.vm, checkpoint, self._guest_init(sandbox.record))
            self.on_stopped(sandbox.id)  # its connections went to the old VM
            await self._unmount_volumes(sandbox)
            self._attach(sandbox, vm)
            try:
                await self._mount_volumes(sandbox)
            except ENGINE_FAILURES as exc:
                failed = f"sandbox {sandbox.id} was reset, but its volumes were not mounted: {exc}"
                raise OperationFailed(failed) from exc

    def _snapshot_metadata(self, sandbox: Sandbox) -> dict[str, str]:
        """A snapshot's metadata: its sandbox, and whether the guest held volume mounts."""
        metadata = {"sandbox_id": sandbox.id}
        if sandbox.record.volume_mounts:
            metadata[VOLUMES_MARK] = "mounted"
        return metadata

    def _snapshot_failed(self, manifest: SnapshotManifest) -> None:
        """A snapshot answered earlier failed to commit: unseal the disk layer it sealed, as soon as
        nothing else runs on its sandbox (a fork waiting for that very commit holds the lock now)."""
        sandbox = self.sandboxes.get(manifest.source.get("sandbox_id", ""))
        if sandbox is None or not manifest.disk_layers:
            return
        task = asyncio.create_task(self._unseal(sandbox, manifest.disk_layers[-1]))
        self._unseals.add(task)
        task.add_done_callback(self._unseals.discard)

    async def _unseal(self, sandbox: Sandbox, layer: str) -> None:
        async with sandbox.lock:
            if sandbox.vm is None or sandbox.record.state != State.RUNNING:
                return  # paused or gone: the sealed layer stays under the top (or goes with it)
            try:
                if await self.engine.unseal(sandbox.vm, layer):
                    log.info("sandbox %s: layer %s unsealed after its snapshot failed", sandbox.id, layer)
            except ENGINE_FAILURES:
                log.exception("sandbox %s: unsealing layer %s failed; it stays sealed", sandbox.id, layer)

    # -- durable pauses: sandboxes moving between nodes (`aenv.snapshot.handover`) ----------

    def _describe(self, sandbox_id: str) -> dict[str, str]:
        sandbox = self.sandboxes.get(sandbox_id)
        return {} if sandbox is None else {SANDBOX_RECORD: json.dumps(asdict(sandbox.record))}

    def _durable(self, sandbox_id: str) -> None:
        """The sandbox's pause was committed to the repository: say so from now on."""
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is not None and sandbox.record.state in (State.PAUSING, State.PAUSED):
            sandbox.record.durable = True
            sandbox.record.generation += 1
            self.store.put(sandbox.record)
            self.on_changed(sandbox_id)  # the scheduler may now resume it on another node

    async def _moved(self, sandbox: Sandbox, exc: SandboxMoved) -> NotFound:
        """Another node took the paused sandbox over: free what is left of it here (lock held)."""
        reason = f"it was taken over by node {exc.node}"
        log.info("sandbox %s is gone from this node: %s", sandbox.id, reason)
        self._lose(sandbox.id, reason)
        with contextlib.suppress(Exception):  # best effort: what stays is the collector's
            await self.engine.kill(self.engine.load_state(sandbox.id))
        self._forget(sandbox)
        return NotFound(f"sandbox {sandbox.id} is not on this node any more: {reason}")

    async def forget_moved(self) -> None:
        """Drop the durably paused sandboxes another node has taken over meanwhile."""
        for sandbox in list(self.sandboxes.values()):
            if sandbox.record.state != State.PAUSED or not sandbox.record.durable or sandbox.lock.locked():
                continue
            with contextlib.suppress(OSError, ValueError):
                state = self.engine.load_state(sandbox.id)
                if moved_to := await asyncio.to_thread(self.engine.handover.moved, state):
                    async with sandbox.lock:
                        if sandbox.record.state == State.PAUSED and sandbox.id in self.sandboxes:
                            await self._moved(sandbox, SandboxMoved(sandbox.id, moved_to))

    async def take_over(self, sandbox_id: str, timeout: int | None) -> Sandbox:
        """Continue here a sandbox paused on another node, from its pause in the repository.

        Its record (tokens, settings, metadata) comes with the pause; the repository's claim
        makes sure only one node continues it, and the node it was paused on forgets it.
        """
        timeout = self.settings.default_timeout if timeout is None else timeout
        self._check_timeout(timeout)
        if sandbox_id in self.sandboxes:
            raise Conflict(f"sandbox {sandbox_id} is on this node: resume it instead")
        try:
            pause = await asyncio.to_thread(self.engine.handover.find, sandbox_id)
            record = SandboxRecord(**json.loads(pause.metadata[SANDBOX_RECORD]))
        except (SnapshotNotFound, InvalidName):
            gone = f"sandbox {sandbox_id} has no durable pause in the repository"
            raise NotFound(gone, PAUSE_GONE) from None
        except (KeyError, ValueError, TypeError) as exc:
            raise OperationFailed(f"the pause of sandbox {sandbox_id} carries no readable record") from exc
        except RepositoryError as exc:
            raise OperationFailed(f"reading the pause of sandbox {sandbox_id} failed: {exc}") from exc
        self.admission.check_start(f"take over sandbox {sandbox_id}", record.memory_mb)
        record.state, record.durable = State.CREATING, False
        sandbox = Sandbox(record)
        self.sandboxes[sandbox_id] = sandbox
        async with sandbox.lock:
            self.store.put(record)
            try:
                with self._transition(sandbox, Op.START):
                    policy = egress_policy(record.allow_internet, record.network)
                    vm = await self.engine.take_over(pause, self._guest_init(record), policy)
                    self._attach(sandbox, vm)
                    self._set_end(sandbox, timeout)
            except PauseReclaimed as exc:
                self._forget(sandbox)
                raise NotFound(f"sandbox {sandbox_id} has no durable pause: {exc}", PAUSE_GONE) from exc
            except SandboxMoved as exc:
                self._forget(sandbox)
                raise Conflict(str(exc)) from exc
            except Exception as exc:  # the claim is given back: another attempt may succeed
                self._forget(sandbox)
                log.exception("taking over sandbox %s failed", sandbox_id)
                raise OperationFailed(f"taking over sandbox {sandbox_id} failed: {exc}") from exc
        self.lost.pop(sandbox_id, None)
        return sandbox

    async def discard_pause(self, sandbox_id: str) -> None:
        """Delete the durable pause of a sandbox killed while the node it was paused on is down.

        Only a shared repository holds other nodes' pauses: a node without one says so
        (`NOT_SHARED`), and a gateway asks another node.
        """
        if sandbox_id in self.sandboxes:
            raise Conflict(f"sandbox {sandbox_id} is on this node: kill it instead")
        if not self.engine.handover.enabled:
            raise Conflict(
                "this node's repository is its own (not shared): it holds no pause of another "
                "node's sandbox", NOT_SHARED,
            )  # fmt: skip
        try:
            pause = await self.engine.handover.discard(sandbox_id)
        except (SnapshotNotFound, InvalidName):
            raise NotFound(f"sandbox {sandbox_id} has no durable pause in the repository") from None
        except SandboxMoved as exc:
            raise Conflict(f"the pause of sandbox {sandbox_id} is claimed by node {exc.node}") from exc
        except Exception as exc:  # the claim, if taken, was given back: a later discard may succeed
            log.exception("discarding the pause of sandbox %s failed", sandbox_id)
            raise OperationFailed(f"discarding the pause of sandbox {sandbox_id} failed: {exc}") from exc
        log.info("discarded pause %s of sandbox %s, killed while its node was down", pause, sandbox_id)

    async def fork(self, sandbox: Sandbox, count: int, timeout: int | None) -> list[Sandbox]:
        if not 1 <= count <= self.settings.max_fork_count:
            raise InvalidRequest(f"count must be between 1 and {self.settings.max_fork_count}")
        if timeout is not None:
            self._check_timeout(timeout)
        self.admission.check_start(f"fork sandbox {sandbox.id}", count * sandbox.record.memory_mb, count)
        async with self._operation(sandbox, Op.FORK):
            assert sandbox.vm is not None
            source = sandbox.record
            ttl = timeout if timeout is not None else source.timeout
            children = [Sandbox(self._child_record(source, ttl)) for _ in range(count)]
            try:
                vms = await self.engine.fork(
                    sandbox.vm, [(child.id, self._guest_init(child.record)) for child in children]
                )
            except ENGINE_FAILURES as exc:
                raise OperationFailed(f"fork of sandbox {sandbox.id} failed: {exc}") from exc
            try:
                for child, vm in zip(children, vms, strict=True):
                    child.vm = vm
                    await self._mount_volumes(child)
            except ENGINE_FAILURES as exc:
                for child in children:
                    await self._kill_vm(child)
                raise OperationFailed(
                    f"mounting the volumes of the forks of {sandbox.id} failed: {exc}"
                ) from exc
            for child, vm in zip(children, vms, strict=True):
                self._attach(child, vm)
                self.sandboxes[child.id] = child
                with self._transition(child, Op.START):
                    self._set_end(child, ttl)
            return children

    def _child_record(self, source: SandboxRecord, ttl: int) -> SandboxRecord:
        now = clock.now()
        return SandboxRecord(
            **{
                **source.__dict__,
                "sandbox_id": new_sandbox_id(),
                "state": State.CREATING,
                "generation": 0,
                "created_at": rfc3339(now),
                "started_at": rfc3339(now),
                "end_at": rfc3339(now + timedelta(seconds=ttl)),
                "timeout": ttl,
                "envd_token": secrets.token_hex(32) if source.secure else None,
                "traffic_token": secrets.token_hex(32) if source.traffic_token else None,
                "metadata": dict(source.metadata),
                "env_vars": dict(source.env_vars),
                "network": dict(source.network),
                "volume_mounts": [dict(m) for m in source.volume_mounts],
                "paused_at": None,
            }
        )

    async def update_network(
        self, sandbox: Sandbox, allow_internet: bool | None, network: dict[str, Any]
    ) -> None:
        """Replace the running sandbox's egress rules at once; resume and fork keep them."""
        keep = {k: v for k, v in sandbox.record.network.items() if k not in ("allowOut", "denyOut")}
        merged = {**keep, **network}
        policy = egress_policy(allow_internet, merged)
        async with self._operation(sandbox, Op.NETWORK):
            assert sandbox.vm is not None
            try:
                await self.engine.set_policy(sandbox.vm, policy)
            except ENGINE_FAILURES as exc:
                raise OperationFailed(f"changing the network of sandbox {sandbox.id} failed: {exc}") from exc
            sandbox.record.network = merged
            sandbox.record.allow_internet = allow_internet

    # -- metrics history -------------------------------------------------------------------

    def _archive(self, sandbox: Sandbox) -> MetricsArchive:
        return MetricsArchive(self.engine.workdir(sandbox.id))

    async def _live_samples(self, sandbox: Sandbox, start: int | None) -> SampleBatch:
        """The samples in the guest's ring since `start`; none without a VM or if envd does not
        answer; `BadGuest` if the guest broke a bound (`aenv.vmm.envd_link`)."""
        if sandbox.vm is None:
            return SampleBatch([], None)
        try:
            return await sandbox.vm.envd.metrics_history(start)
        except GuestAnswerError as exc:
            raise BadGuest(
                f"the guest of sandbox {sandbox.id} answered its metrics wrongly: {exc}", exc.code
            ) from exc
        except (OSError, RuntimeError, ValueError, KeyError, HTTPException) as exc:
            log.warning("metrics of sandbox %s: envd did not answer: %s", sandbox.id, exc)
            return SampleBatch([], None)

    async def _save_samples(self, sandbox: Sandbox) -> None:
        """Before a pause: keep the guest's samples with the sandbox, for while it is paused and
        for a resume that boots a new guest (a filesystem-only pause)."""
        if not sandbox.samples.due(time.monotonic()):
            return  # the guest has no sample the archive lacks
        archive = self._archive(sandbox)
        previous = newest = archive.newest()
        try:
            batch = await self._live_samples(sandbox, None if newest is None else newest + 1)
        except BadGuest as exc:  # its own history is what the guest loses, not its pause
            log.warning("%s", exc.message)
            return
        if batch.samples:
            with contextlib.suppress(OSError):
                archive.add(batch.samples)
            newest = max(newest or 0, batch.samples[-1]["ts"])
        sandbox.samples.saved(newest, previous, time.time(), batch.next_in)

    async def metrics(self, sandbox: Sandbox, start: int | None, end: int | None) -> list[dict[str, Any]]:
        """The sandbox's samples with `start <= time <= end` (Unix seconds), oldest first.

        A guest's ring may hold samples from before the sandbox existed (its template's or fork
        source's): only the sandbox's own lifetime counts.
        """
        born = int(_parse(sandbox.record.created_at).timestamp())
        start = born if start is None else max(start, born)
        running = sandbox.record.state == State.RUNNING
        live = (await self._live_samples(sandbox, start)).samples if running else []
        samples = merge(self._archive(sandbox).load(), live)
        return [sandbox_metric(s, sandbox.record.cpu_count) for s in between(samples, start, end)]

    async def latest_metrics(self, sandboxes: list[Sandbox]) -> dict[str, dict[str, Any]]:
        """Each sandbox's newest sample (the cluster-wide view); sandboxes without one are left out."""
        recent = int(time.time()) - RECENT_SECONDS

        async def newest(sandbox: Sandbox) -> dict[str, Any] | None:
            try:
                samples = await self.metrics(sandbox, recent, None) or await self.metrics(sandbox, None, None)
            except BadGuest:  # that guest's failure, not the others' view
                return None
            return samples[-1] if samples else None

        found = await asyncio.gather(*(newest(s) for s in sandboxes))
        return {s.id: metric for s, metric in zip(sandboxes, found, strict=True) if metric is not None}

    # -- proxy support ---------------------------------------------------------------------

    async def running_vm(self, sandbox_id: str, *, resume: bool) -> Sandbox | None:
        """The sandbox if it runs; a paused one with auto-resume on is resumed first when asked."""
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            return None
        if sandbox.record.state in (State.PAUSED, State.PAUSING) and resume and sandbox.record.auto_resume:
            async with sandbox.lock:
                if sandbox.record.state == State.PAUSED:
                    timeout = max(sandbox.record.timeout, AUTO_RESUME_MIN_TIMEOUT)
                    with contextlib.suppress(SandboxError):
                        await self._resume_locked(sandbox, timeout)
        # Pausing or killing: traffic gets the proxy's 502 rather than a VM about to go away.
        serving = sandbox.record.state in (State.RUNNING, State.SNAPSHOTTING, State.FORKING)
        return sandbox if serving and sandbox.vm is not None else None

    # -- TTL -------------------------------------------------------------------------------

    async def _evict_forever(self) -> None:
        checked = time.monotonic()
        while not self._closing:
            await asyncio.sleep(self.settings.evict_interval)
            await self.evict_expired()
            if self.engine.handover.enabled and time.monotonic() - checked > MOVED_CHECK_SECONDS:
                checked = time.monotonic()
                await self.forget_moved()

    async def evict_expired(self) -> None:
        """Pause (autoPause) or kill every running sandbox whose end time has passed."""
        now = clock.now()
        for sandbox in list(self.sandboxes.values()):
            record = sandbox.record
            if record.state != State.RUNNING or sandbox.lock.locked() or _parse(record.end_at) > now:
                continue
            with logs.sandbox_context(record.sandbox_id):
                await self._expire(sandbox)

    async def _expire(self, sandbox: Sandbox) -> None:
        """Pause or kill one sandbox whose end time has passed, unless a call changed it since."""
        record = sandbox.record
        started = time.monotonic()
        try:
            async with sandbox.lock:
                if record.state != State.RUNNING or _parse(record.end_at) > clock.now():
                    return
                if record.auto_pause:
                    await self._pause_locked(sandbox, memory=record.auto_pause_memory)
                else:
                    await self._kill_locked(sandbox)
            log.info(
                "sandbox %s expired: %s in %.0f ms",
                record.sandbox_id,
                "paused" if record.auto_pause else "killed",
                1000 * (time.monotonic() - started),
            )
        except SandboxError as exc:
            log.error("expiring sandbox %s failed: %s", record.sandbox_id, exc.message)


@contextlib.contextmanager
def engine_errors(what: str) -> Iterator[None]:
    """The snapshot engine's refusals and failures of a snapshot, checkpoint or reset as the node
    service's kinds; `what` names the operation in a failure's message."""
    try:
        yield
    except (InvalidName, InvalidCheckpoint) as exc:
        raise InvalidRequest(str(exc)) from exc
    except (AliasConflict, SnapshotExists, CheckpointConflict) as exc:
        raise Conflict(str(exc)) from exc
    except CheckpointNotFound as exc:
        raise NotFound(str(exc)) from exc
    except ENGINE_FAILURES as exc:
        log.warning("%s failed: %s", what, exc)
        raise OperationFailed(f"{what} failed: {exc}") from exc


def _start_failure(exc: Exception) -> SandboxError:
    """What a client is told when a new sandbox did not start.

    A guest that did not answer in time was starved of CPU (a saturated node, under TCG most
    often): nothing is wrong with the request, and the same create succeeds once the node has
    room, so that is a retryable 503 rather than a 500."""
    if isinstance(exc, TimeoutError | EnvdUnavailable):
        return Unavailable(f"the sandbox's guest did not answer in time, the node is overloaded: {exc}")
    return OperationFailed(f"creating the sandbox failed: {exc}")
