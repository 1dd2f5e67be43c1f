"""The sandbox lifecycle: one state machine per sandbox, TTLs, and persistence across restarts.

Operations on one sandbox are serialized by its lock; its state (`store.py`) shows what is
happening meanwhile, and the API reports it truthfully. Running sandboxes are paused (or
killed, by configuration) when the node stops; after a crash, VMs that outlived the node are
adopted and paused, so a restart loses nothing silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from ..config import Settings
from ..guest.envd import ENVD_VERSION
from ..network.egress import EgressPolicy
from ..network.netns import SandboxNetwork
from ..snapshot.engine import EngineError, GuestInit, SandboxVM, SnapshotEngine
from ..snapshot.manifest import SnapshotManifest
from ..snapshot.repository import RepositoryError, SnapshotNotFound
from .store import (
    CREATING,
    FORKING,
    KILLING,
    PAUSED,
    PAUSING,
    RESUMING,
    RUNNING,
    SNAPSHOTTING,
    SandboxRecord,
    SandboxStore,
)

log = logging.getLogger(__name__)

DISK_SIZE_MB = 4096
AUTO_RESUME_MIN_TIMEOUT = 300


class SandboxError(Exception):
    """An operation refused or failed; `status` is the HTTP status the API answers with."""

    def __init__(self, status: int, message: str, error_code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_code = error_code


def _now() -> datetime:
    return datetime.now(UTC)


def _iso(moment: datetime) -> str:
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


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
        raise SandboxError(400, str(exc)) from exc


def catalog_name(reference: str) -> str:
    """A template or snapshot reference as E2B spells it (`namespace/name:tag`) reduced to its name."""
    return reference.rsplit("/", 1)[-1].split(":", 1)[0]


def new_sandbox_id() -> str:
    """`i` + 20 characters of [a-z0-9], as E2B's: no dashes or dots, which would break host routing."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return "i" + "".join(secrets.choice(alphabet) for _ in range(20))


@dataclass
class Sandbox:
    """A sandbox as the node holds it: its record, its VM while running, its lock."""

    record: SandboxRecord
    vm: SandboxVM | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def id(self) -> str:
        return self.record.sandbox_id


@dataclass(frozen=True)
class CreateRequest:
    template: str
    timeout: int
    auto_pause: bool = False
    auto_resume: bool = False
    secure: bool = True
    allow_internet: bool | None = None
    network: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)


class Orchestrator:
    """Owns every sandbox on this node."""

    def __init__(self, settings: Settings, engine: SnapshotEngine, store: SandboxStore):
        self.settings = settings
        self.engine = engine
        self.store = store
        self.sandboxes: dict[str, Sandbox] = {}
        self.counters = {"create_successes": 0, "create_failures": 0}
        self._evictor: asyncio.Task[None] | None = None
        self._closing = False
        # Called with a sandbox id when its VM stops (pause, kill): the proxy drops its connections.
        self.on_stopped: Callable[[str], None] = lambda sandbox_id: None

    # -- startup and shutdown --------------------------------------------------------------

    def surviving_networks(self) -> list[str]:
        """Namespaces of sandboxes a previous node process may have left running."""
        names = []
        for record in self.store.all():
            if record.state != PAUSED:
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
            if record.state != PAUSED:
                await self._recover(sandbox, networks or {})
            else:
                await self._settle(sandbox)
        self._evictor = asyncio.create_task(self._evict_forever())

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
            self._mark_paused(sandbox)
            await self._settle(sandbox)
            return
        try:
            vm = await self.engine.adopt(state, record.envd_token, networks.get(state.network_name))
            sandbox.vm = vm
            await self._pause_locked(sandbox)
            log.info("sandbox %s outlived the node process and was paused", record.sandbox_id)
        except (EngineError, OSError) as exc:
            log.error("sandbox %s was lost with the previous node process: %s", record.sandbox_id, exc)
            network = networks.get(state.network_name)
            if network is not None:
                network.destroy()  # the pool's own object, so its slot is freed
            with contextlib.suppress(Exception):
                await self.engine.kill(state)
            self._forget(sandbox)

    async def _settle(self, sandbox: Sandbox) -> None:
        """A paused sandbox whose process the previous node process kept: save it, end the process."""
        try:
            await self.engine.settle_paused(self.engine.load_state(sandbox.id))
        except (EngineError, OSError, LookupError) as exc:
            log.error("paused sandbox %s was lost with the previous node process: %s", sandbox.id, exc)
            with contextlib.suppress(Exception):
                await self.engine.kill(self.engine.load_state(sandbox.id))
            self._forget(sandbox)

    async def close(self) -> None:
        """Pause (or kill, by configuration) every running sandbox, then stop."""
        self._closing = True
        if self._evictor is not None:
            self._evictor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._evictor
        await self.engine.close()
        for sandbox in list(self.sandboxes.values()):
            async with sandbox.lock:
                if sandbox.vm is None:
                    continue
                try:
                    if self.settings.shutdown_action == "pause":
                        await self._pause_locked(sandbox)
                    else:
                        await self._kill_locked(sandbox)
                except Exception as exc:
                    log.error("stopping sandbox %s failed: %s", sandbox.id, exc)
        self.store.close()

    # -- lookups ---------------------------------------------------------------------------

    def get(self, sandbox_id: str) -> Sandbox:
        sandbox = self.sandboxes.get(sandbox_id.split("-", 1)[0])
        if sandbox is None or sandbox.record.state == KILLING:
            raise SandboxError(404, f"Sandbox \"{sandbox_id}\" doesn't exist or you don't have access to it")
        return sandbox

    def resolve_template(self, reference: str) -> SnapshotManifest:
        """A template or snapshot by id or alias; `namespace/` prefixes and `:tag` suffixes are ignored."""
        try:
            return self.engine.repository.get(catalog_name(reference))
        except (SnapshotNotFound, RepositoryError):
            raise SandboxError(404, f"template '{reference}' not found") from None

    # -- create ----------------------------------------------------------------------------

    async def create(self, request: CreateRequest) -> Sandbox:
        manifest = self.resolve_template(request.template)
        policy = egress_policy(request.allow_internet, request.network)
        if request.timeout > self.settings.max_timeout:
            raise SandboxError(400, f"timeout must be at most {self.settings.max_timeout} seconds")
        now = _now()
        record = SandboxRecord(
            sandbox_id=new_sandbox_id(),
            template_id=manifest.id,
            alias=manifest.alias,
            state=CREATING,
            created_at=_iso(now),
            started_at=_iso(now),
            end_at=_iso(now + timedelta(seconds=request.timeout)),
            timeout=request.timeout,
            auto_pause=request.auto_pause,
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
        )
        sandbox = Sandbox(record)
        self.sandboxes[record.sandbox_id] = sandbox
        async with sandbox.lock:
            self.store.put(record)
            try:
                sandbox.vm = await self.engine.start(
                    manifest.id, record.sandbox_id, self._guest_init(record), policy
                )
            except Exception as exc:
                self.counters["create_failures"] += 1
                self._forget(sandbox)
                log.exception("creating sandbox %s from %s failed", record.sandbox_id, manifest.id)
                raise SandboxError(500, f"creating the sandbox failed: {exc}") from exc
            self._set_running(sandbox, timeout=request.timeout)
        self.counters["create_successes"] += 1
        return sandbox

    def _guest_init(self, record: SandboxRecord) -> GuestInit:
        return GuestInit(env_vars=record.env_vars, access_token=record.envd_token)

    def _set_running(self, sandbox: Sandbox, *, timeout: int | None = None) -> None:
        record = sandbox.record
        record.state = RUNNING
        record.paused_at = None
        if timeout is not None:
            record.end_at = _iso(_now() + timedelta(seconds=timeout))
        self.store.put(record)

    def _mark_paused(self, sandbox: Sandbox) -> None:
        self.on_stopped(sandbox.id)
        sandbox.vm = None
        sandbox.record.state = PAUSED
        sandbox.record.paused_at = sandbox.record.paused_at or _iso(_now())
        self.store.put(sandbox.record)

    def _forget(self, sandbox: Sandbox) -> None:
        self.sandboxes.pop(sandbox.id, None)
        self.store.delete(sandbox.id)

    # -- operations ------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _operation(
        self, sandbox: Sandbox, transient: str, allowed: tuple[str, ...], verb: str
    ) -> AsyncIterator[None]:
        """Hold the sandbox's lock in a transitional state; refuse it from the wrong state."""
        async with sandbox.lock:
            if sandbox.record.state == KILLING or sandbox.id not in self.sandboxes:
                raise SandboxError(404, f"sandbox {sandbox.id} not found")
            if sandbox.record.state not in allowed:
                raise SandboxError(409, f"sandbox cannot be {verb} from {sandbox.record.state} state")
            previous = sandbox.record.state
            sandbox.record.state = transient
            try:
                yield
            finally:
                if sandbox.record.state == transient:
                    sandbox.record.state = previous

    async def pause(self, sandbox: Sandbox) -> None:
        if sandbox.record.state in (PAUSED, PAUSING):
            raise SandboxError(409, f"sandbox {sandbox.id} is already paused")
        async with sandbox.lock:
            if sandbox.record.state == PAUSED:
                raise SandboxError(409, f"sandbox {sandbox.id} is already paused")
            if sandbox.record.state != RUNNING or sandbox.vm is None:
                raise SandboxError(409, f"sandbox cannot be paused from {sandbox.record.state} state")
            await self._pause_locked(sandbox)

    async def _pause_locked(self, sandbox: Sandbox) -> None:
        assert sandbox.vm is not None
        sandbox.record.state = PAUSING
        try:
            await self.engine.pause(sandbox.vm)
        except Exception as exc:
            sandbox.record.state = RUNNING if sandbox.vm.vm.alive() else sandbox.record.state
            raise SandboxError(500, f"pausing sandbox {sandbox.id} failed: {exc}") from exc
        sandbox.record.paused_at = _iso(_now())
        self._mark_paused(sandbox)

    async def connect(self, sandbox: Sandbox, timeout: int | None) -> bool:
        """Resume a paused sandbox or extend a running one's TTL; returns whether it resumed."""
        timeout = self.settings.default_timeout if timeout is None else timeout
        async with sandbox.lock:
            if sandbox.id not in self.sandboxes or sandbox.record.state == KILLING:
                raise SandboxError(404, f"sandbox {sandbox.id} not found")
            if sandbox.record.state == RUNNING:
                self._extend(sandbox, timeout)
                return False
            await self._resume_locked(sandbox, timeout)
            return True

    async def _resume_locked(self, sandbox: Sandbox, timeout: int) -> None:
        record = sandbox.record
        record.state = RESUMING
        try:
            state = self.engine.load_state(record.sandbox_id)
            sandbox.vm = await self.engine.resume(state, self._guest_init(record))
        except Exception as exc:
            record.state = PAUSED
            log.exception("resuming sandbox %s failed", record.sandbox_id)
            raise SandboxError(500, f"resuming sandbox {record.sandbox_id} failed: {exc}") from exc
        self._set_running(sandbox, timeout=timeout)

    def _extend(self, sandbox: Sandbox, timeout: int) -> None:
        """Move the end time later, never earlier (connect and refreshes)."""
        wanted = _now() + timedelta(seconds=timeout)
        if wanted > _parse(sandbox.record.end_at):
            sandbox.record.end_at = _iso(wanted)
            self.store.put(sandbox.record)

    async def set_timeout(self, sandbox: Sandbox, timeout: int) -> None:
        if timeout > self.settings.max_timeout:
            raise SandboxError(400, f"timeout must be at most {self.settings.max_timeout} seconds")
        async with sandbox.lock:
            if sandbox.record.state != RUNNING:
                raise SandboxError(404, f"sandbox {sandbox.id} is not running")
            sandbox.record.end_at = _iso(_now() + timedelta(seconds=timeout))
            self.store.put(sandbox.record)

    async def refresh(self, sandbox: Sandbox, duration: int | None) -> None:
        async with sandbox.lock:
            if sandbox.record.state != RUNNING:
                raise SandboxError(404, f"sandbox {sandbox.id} is not running")
            self._extend(sandbox, self.settings.default_timeout if duration is None else duration)

    async def kill(self, sandbox: Sandbox) -> None:
        async with sandbox.lock:
            if sandbox.id not in self.sandboxes:
                raise SandboxError(404, f"sandbox {sandbox.id} not found")
            await self._kill_locked(sandbox)

    async def _kill_locked(self, sandbox: Sandbox) -> None:
        sandbox.record.state = KILLING
        self.store.put(sandbox.record)
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

    async def snapshot(self, sandbox: Sandbox, name: str | None) -> SnapshotManifest:
        async with self._operation(sandbox, SNAPSHOTTING, (RUNNING,), "snapshotted"):
            assert sandbox.vm is not None
            try:
                return await self.engine.snapshot(sandbox.vm, alias=name, metadata={"sandbox_id": sandbox.id})
            except RepositoryError as exc:
                raise SandboxError(400, str(exc)) from exc
            except Exception as exc:
                raise SandboxError(500, f"snapshot of sandbox {sandbox.id} failed: {exc}") from exc

    async def fork(self, sandbox: Sandbox, count: int, timeout: int | None) -> list[Sandbox]:
        if not 1 <= count <= self.settings.max_fork_count:
            raise SandboxError(400, f"count must be between 1 and {self.settings.max_fork_count}")
        async with self._operation(sandbox, FORKING, (RUNNING,), "forked"):
            assert sandbox.vm is not None
            source = sandbox.record
            ttl = timeout if timeout is not None else source.timeout
            children = [self._child_record(source, ttl) for _ in range(count)]
            try:
                vms = await self.engine.fork(
                    sandbox.vm, [(child.sandbox_id, self._guest_init(child)) for child in children]
                )
            except Exception as exc:
                raise SandboxError(500, f"fork of sandbox {sandbox.id} failed: {exc}") from exc
            started = []
            for child, vm in zip(children, vms, strict=True):
                forked = Sandbox(child, vm=vm)
                self.sandboxes[child.sandbox_id] = forked
                self._set_running(forked, timeout=ttl)
                started.append(forked)
            return started

    def _child_record(self, source: SandboxRecord, ttl: int) -> SandboxRecord:
        now = _now()
        return SandboxRecord(
            **{
                **source.__dict__,
                "sandbox_id": new_sandbox_id(),
                "state": CREATING,
                "created_at": _iso(now),
                "started_at": _iso(now),
                "end_at": _iso(now + timedelta(seconds=ttl)),
                "timeout": ttl,
                "envd_token": secrets.token_hex(32) if source.secure else None,
                "traffic_token": secrets.token_hex(32) if source.traffic_token else None,
                "metadata": dict(source.metadata),
                "env_vars": dict(source.env_vars),
                "network": dict(source.network),
                "paused_at": None,
            }
        )

    async def update_network(
        self, sandbox: Sandbox, allow_internet: bool | None, network: dict[str, Any]
    ) -> None:
        async with sandbox.lock:
            if sandbox.record.state != RUNNING:
                raise SandboxError(409, f"sandbox network cannot be changed in {sandbox.record.state} state")
            keep = {k: v for k, v in sandbox.record.network.items() if k not in ("allowOut", "denyOut")}
            sandbox.record.network = {**keep, **network}
            sandbox.record.allow_internet = allow_internet
            self.store.put(sandbox.record)

    async def metrics(self, sandbox: Sandbox) -> list[dict[str, Any]]:
        if sandbox.record.state != RUNNING or sandbox.vm is None:
            return []
        sample = await sandbox.vm.envd.metrics()
        now = _now()
        return [
            {
                "timestamp": _iso(now),
                "timestampUnix": int(now.timestamp()),
                "cpuCount": sample.get("cpu_count", sandbox.record.cpu_count),
                "cpuUsedPct": sample.get("cpu_used_pct", 0.0),
                "memUsed": sample.get("mem_used", 0),
                "memTotal": sample.get("mem_total", 0),
                "memCache": sample.get("mem_cache", 0),
                "diskUsed": sample.get("disk_used", 0),
                "diskTotal": sample.get("disk_total", 0),
            }
        ]

    # -- proxy support ---------------------------------------------------------------------

    async def running_vm(self, sandbox_id: str, *, resume: bool) -> Sandbox | None:
        """The sandbox if it runs; a paused one with auto-resume on is resumed first when asked."""
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            return None
        if sandbox.record.state in (PAUSED, PAUSING) and resume and sandbox.record.auto_resume:
            async with sandbox.lock:
                if sandbox.record.state == PAUSED:
                    timeout = max(sandbox.record.timeout, AUTO_RESUME_MIN_TIMEOUT)
                    with contextlib.suppress(SandboxError):
                        await self._resume_locked(sandbox, timeout)
        # Pausing or killing: traffic gets the proxy's 502 rather than a VM about to go away.
        serving = sandbox.record.state in (RUNNING, SNAPSHOTTING, FORKING)
        return sandbox if serving and sandbox.vm is not None else None

    # -- TTL -------------------------------------------------------------------------------

    async def _evict_forever(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.settings.evict_interval)
            await self.evict_expired()

    async def evict_expired(self) -> None:
        """Pause (autoPause) or kill every running sandbox whose end time has passed."""
        now = _now()
        for sandbox in list(self.sandboxes.values()):
            record = sandbox.record
            if record.state != RUNNING or sandbox.lock.locked() or _parse(record.end_at) > now:
                continue
            started = time.monotonic()
            try:
                async with sandbox.lock:
                    if record.state != RUNNING or _parse(record.end_at) > _now():
                        continue
                    if record.auto_pause:
                        await self._pause_locked(sandbox)
                    else:
                        await self._kill_locked(sandbox)
                log.info(
                    "sandbox %s expired: %s in %.0f ms",
                    record.sandbox_id,
                    "paused" if record.auto_pause else "killed",
                    1000 * (time.monotonic() - started),
                )
            except Exception as exc:
                log.error("expiring sandbox %s failed: %s", record.sandbox_id, exc)
