"""Lifecycle operations on this node's sandboxes: create, pause, resume, kill, fork, TTL changes.

Each operation takes the sandbox's lock and runs under its transition (`SandboxTable`), so its
state shows what is happening meanwhile and the API reports it truthfully. A started VM is
watched: a QEMU that exits without the node ending it loses the sandbox, with the reason kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import timedelta
from typing import Any

from .. import clock
from ..clock import rfc3339
from ..config import Settings
from ..events import SandboxLost
from ..snapshot.handover import SandboxMoved
from ..snapshot.model import SandboxVM
from ..vmm.envd_link import GuestAnswerError
from .admission import Admission
from .backend import SandboxBackend
from .catalog import Catalog
from .errors import (
    BadGuest,
    Conflict,
    InvalidRequest,
    NotFound,
    OperationFailed,
    SandboxError,
)
from .failures import ENGINE_FAILURES, start_failure
from .history import MetricsHistory
from .ids import chosen_id
from .interface import CreateRequest
from .launch import LaunchPlan, check_timeout, egress_policy, guest_init
from .mounting import VOLUMES_MARK, VolumeMounts
from .sandboxes import Sandbox, SandboxTable, parse_time
from .starts import StartGate
from .states import Op, State

log = logging.getLogger(__name__)

AUTO_RESUME_MIN_TIMEOUT = 300


def _exit_reason(code: int) -> str:
    """A QEMU exit status in words; -1: an adopted process, whose status only its parent saw."""
    if code == -1:
        return "status unknown"
    return f"killed by signal {-code}" if code < 0 else f"exit status {code}"


class Lifecycle:
    """Runs the operations on the sandboxes of `table` through the engine's facade."""

    def __init__(
        self,
        settings: Settings,
        engine: SandboxBackend,
        table: SandboxTable,
        *,
        catalog: Catalog,
        mounts: VolumeMounts,
        history: MetricsHistory,
        admission: Admission,
    ):
        self.settings = settings
        self.engine = engine
        self.table = table
        self.catalog = catalog
        self.mounts = mounts
        self.history = history
        self.admission = admission
        self.counters = {"create_successes": 0, "create_failures": 0, "lost": 0}
        self.starts = StartGate()  # creates under way at once, and how long the rest may wait
        self._watchers: dict[int, asyncio.Task[None]] = {}  # by id() of the SandboxVM they watch

    def timeout(self, requested: int | None) -> int:
        """The timeout of a start or resume: the default if none was asked, 400 above the maximum."""
        timeout = self.settings.default_timeout if requested is None else requested
        check_timeout(timeout, self.settings.max_timeout)
        return timeout

    def stop_watching(self) -> None:
        for watcher in list(self._watchers.values()):
            watcher.cancel()

    # -- create ----------------------------------------------------------------------------

    async def create(self, request: CreateRequest) -> Sandbox:
        # Before the template's lookup (files read and parsed): at 256 rollouts at once, creates
        # refused here came back every 0.5 s, and their lookups were 18 % of the loop's work.
        self.starts.check("create a sandbox")
        manifest = await self.catalog.resolve(request.template)  # 404 before the request's 400s
        egress_policy(request.allow_internet, request.network)  # 400 before anything starts
        timeout = self.timeout(request.timeout)
        self.mounts.check(request.volume_mounts)
        sandbox_id = chosen_id(request.sandbox_id)
        if sandbox_id in self.table:
            raise Conflict(f"sandbox {sandbox_id} exists already")
        # A warm VM of the template has its network already.
        networks = 0 if self.catalog.warm(manifest.id)[1] else 1
        self.admission.check_start("create a sandbox", manifest.machine.memory_mib, networks)
        plan = LaunchPlan.create(request, sandbox_id, manifest, timeout)
        record = plan.record
        sandbox = self.table.add(record)
        async with sandbox.lock, self.starts.turn():
            try:
                with self.table.transition(sandbox, Op.START):
                    vm = await self.engine.start(manifest.id, record.sandbox_id, plan.init, plan.policy)
                    # A warm VM's guest may keep the token it was given in the pool (`WarmVMs.claim`).
                    record.envd_token = vm.guest.envd.access_token
                    self.attach(sandbox, vm)
                    try:
                        await self.mounts.mount(sandbox, stale=VOLUMES_MARK in manifest.metadata)
                    except BaseException:
                        await self.kill_vm(sandbox)
                        raise
                    sandbox.set_end(timeout)
            except Exception as exc:  # any failure to start: the sandbox never existed
                self.counters["create_failures"] += 1
                self.table.forget(sandbox)
                log.exception("creating sandbox %s from %s failed", record.sandbox_id, manifest.id)
                raise start_failure(exc) from exc
        self.counters["create_successes"] += 1
        return sandbox

    async def kill_vm(self, sandbox: Sandbox) -> None:
        """End a VM that started but cannot be handed out (its volumes failed); the caller forgets it."""
        vm, sandbox.vm = sandbox.vm, None
        await self.mounts.unmount(sandbox)
        if vm is not None:
            with contextlib.suppress(*ENGINE_FAILURES):
                await self.engine.kill(vm)

    # -- VM processes that die -------------------------------------------------------------

    def attach(self, sandbox: Sandbox, vm: SandboxVM) -> None:
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
            if sandbox.vm is not vm or sandbox.id not in self.table:
                return
            exited = _exit_reason(code)
            reason = f"its VM process {vm.vm.pid} exited unexpectedly ({exited}) at {rfc3339(clock.now())}"
            log.error("sandbox %s was lost: %s", sandbox.id, reason)
            self.table.lose(sandbox.id, reason)
            self.table.publish(SandboxLost(sandbox.id, reason))
            try:
                await self.kill_locked(sandbox)
            except ENGINE_FAILURES as exc:  # the record is gone either way; leftovers are for GC
                log.error("cleaning up lost sandbox %s failed: %s", sandbox.id, exc)

    # -- pause and resume ------------------------------------------------------------------

    async def pause(self, sandbox: Sandbox, *, memory: bool = True) -> None:
        """Pause the sandbox; without `memory` only its disk is kept and its resume boots afresh."""
        self.admission.check_disk(f"pause sandbox {sandbox.id}")
        async with sandbox.lock:
            await self.pause_locked(sandbox, memory=memory)

    async def pause_locked(self, sandbox: Sandbox, *, memory: bool = True) -> None:
        with self.table.transition(sandbox, Op.PAUSE):
            assert sandbox.vm is not None
            await self.history.save(sandbox)
            try:
                await self.engine.pause(sandbox.vm, memory=memory)
            except ENGINE_FAILURES as exc:
                raise OperationFailed(f"pausing sandbox {sandbox.id} failed: {exc}") from exc
            sandbox.record.paused_at = rfc3339(clock.now())
            self.table.stopped(sandbox)
            await self.mounts.unmount(sandbox)

    async def connect(self, sandbox: Sandbox, timeout: int | None, *, memory: bool = True) -> bool:
        """Resume a paused sandbox or extend a running one's TTL; returns whether it resumed.

        Without `memory` a paused sandbox boots afresh from its disk, whatever its pause kept.
        """
        timeout = self.timeout(timeout)
        async with sandbox.lock:
            if sandbox.record.state == State.RUNNING:
                with self.table.transition(sandbox, Op.EXTEND):
                    sandbox.extend(timeout)
                return False
            await self._forget_memory(sandbox, memory)
            await self.resume_locked(sandbox, timeout)
            return True

    async def resume(self, sandbox: Sandbox, timeout: int | None, *, memory: bool = True) -> None:
        """Resume a paused sandbox (409 if it runs: the legacy `/resume` route's contract)."""
        timeout = self.timeout(timeout)
        async with sandbox.lock:
            await self._forget_memory(sandbox, memory)
            await self.resume_locked(sandbox, timeout)

    async def _forget_memory(self, sandbox: Sandbox, memory: bool) -> None:
        """A resume asked to ignore the pause's memory: make it boot from the disk (lock held)."""
        if memory or sandbox.record.state != State.PAUSED:
            return
        try:
            await self.engine.drop_memory(sandbox.id)
        except ENGINE_FAILURES as exc:
            raise OperationFailed(f"resuming sandbox {sandbox.id} from its disk failed: {exc}") from exc

    async def resume_locked(self, sandbox: Sandbox, timeout: int) -> None:
        record = sandbox.record
        with self.table.transition(sandbox, Op.RESUME):
            self.admission.check_start(f"resume sandbox {record.sandbox_id}", record.memory_mb)
            try:
                state = self.engine.load_state(record.sandbox_id)
                if state.disk_only:  # a new guest boots, whose samples start afresh
                    sandbox.samples.reset()
                sandbox.samples.running(time.monotonic())  # before its `cont`
                self.attach(sandbox, await self.engine.resume(state, guest_init(record)))
            except SandboxMoved as exc:
                raise await self.moved(sandbox, exc.node) from exc
            except GuestAnswerError as exc:  # its own guest's doing: it stays paused
                log.warning("resuming sandbox %s failed: %s", record.sandbox_id, exc)
                raise BadGuest(f"resuming sandbox {record.sandbox_id} failed: {exc}", exc.code) from exc
            except ENGINE_FAILURES as exc:
                log.exception("resuming sandbox %s failed", record.sandbox_id)
                raise OperationFailed(f"resuming sandbox {record.sandbox_id} failed: {exc}") from exc
            try:
                await self.mounts.mount(sandbox)
            except ENGINE_FAILURES as exc:  # paused again, so that the state reported is the truth
                log.exception("mounting the volumes of resumed sandbox %s failed", record.sandbox_id)
                await self._pause_again(sandbox)
                raise OperationFailed(
                    f"mounting the volumes of sandbox {record.sandbox_id} failed: {exc}"
                ) from exc
            sandbox.set_end(timeout)
            record.durable = False

    async def _pause_again(self, sandbox: Sandbox) -> None:
        """Undo a resume whose volumes could not be mounted (the guest has not run user work)."""
        assert sandbox.vm is not None
        try:
            await self.engine.pause(sandbox.vm)
        except ENGINE_FAILURES:
            log.exception("pausing sandbox %s again failed: killing its VM", sandbox.id)
            await self.engine.kill(sandbox.vm)
        self.table.stopped(sandbox)
        await self.mounts.unmount(sandbox)

    async def moved(self, sandbox: Sandbox, node: str) -> NotFound:
        """Another node took the paused sandbox over: free what is left of it here (lock held)."""
        reason = f"it was taken over by node {node}"
        log.info("sandbox %s is gone from this node: %s", sandbox.id, reason)
        self.table.lose(sandbox.id, reason)
        with contextlib.suppress(Exception):  # best effort: what stays is the collector's
            await self.engine.kill(self.engine.load_state(sandbox.id))
        self.table.forget(sandbox)
        return NotFound(f"sandbox {sandbox.id} is not on this node any more: {reason}")

    async def running_vm(self, sandbox_id: str, *, resume: bool) -> Sandbox | None:
        """The sandbox if it runs; a paused one with auto-resume on is resumed first when asked."""
        sandbox = self.table.find(sandbox_id)
        if sandbox is None:
            return None
        if sandbox.record.state in (State.PAUSED, State.PAUSING) and resume and sandbox.record.auto_resume:
            async with sandbox.lock:
                if sandbox.record.state == State.PAUSED:
                    timeout = max(sandbox.record.timeout, AUTO_RESUME_MIN_TIMEOUT)
                    with contextlib.suppress(SandboxError):
                        await self.resume_locked(sandbox, timeout)
        # Pausing or killing: traffic gets the proxy's 502 rather than a VM about to go away.
        serving = sandbox.record.state in (State.RUNNING, State.SNAPSHOTTING, State.FORKING)
        return sandbox if serving and sandbox.vm is not None else None

    # -- TTL and kill ----------------------------------------------------------------------

    async def set_timeout(self, sandbox: Sandbox, timeout: int) -> None:
        check_timeout(timeout, self.settings.max_timeout)
        async with self.table.operation(sandbox, Op.EXTEND):
            sandbox.record.end_at = rfc3339(clock.now() + timedelta(seconds=timeout))

    async def refresh(self, sandbox: Sandbox, duration: int | None) -> None:
        async with self.table.operation(sandbox, Op.EXTEND):
            sandbox.extend(self.settings.default_timeout if duration is None else duration)

    def expired(self, sandbox: Sandbox) -> bool:
        """Whether the sandbox runs past its end time."""
        record = sandbox.record
        return record.state == State.RUNNING and parse_time(record.end_at) <= clock.now()

    async def kill(self, sandbox: Sandbox) -> None:
        async with sandbox.lock:
            await self.kill_locked(sandbox)

    async def kill_locked(self, sandbox: Sandbox) -> None:
        with self.table.transition(sandbox, Op.KILL):
            try:
                if sandbox.vm is not None:
                    await self.engine.kill(sandbox.vm)
                else:
                    with contextlib.suppress(OSError):
                        await self.engine.kill(self.engine.load_state(sandbox.id))
            finally:
                self.table.killed(sandbox)
                await self.mounts.unmount(sandbox)

    # -- fork and network ------------------------------------------------------------------

    async def fork(self, sandbox: Sandbox, count: int, timeout: int | None) -> list[Sandbox]:
        if not 1 <= count <= self.settings.max_fork_count:
            raise InvalidRequest(f"count must be between 1 and {self.settings.max_fork_count}")
        if timeout is not None:
            check_timeout(timeout, self.settings.max_timeout)
        self.admission.check_start(f"fork sandbox {sandbox.id}", count * sandbox.record.memory_mb, count)
        async with self.table.operation(sandbox, Op.FORK):
            assert sandbox.vm is not None
            ttl = timeout if timeout is not None else sandbox.record.timeout
            plans = [LaunchPlan.fork_child(sandbox.record, ttl) for _ in range(count)]
            children = [Sandbox(plan.record) for plan in plans]
            try:
                vms = await self.engine.fork(
                    sandbox.vm, [(plan.record.sandbox_id, plan.init) for plan in plans]
                )
            except ENGINE_FAILURES as exc:
                raise OperationFailed(f"fork of sandbox {sandbox.id} failed: {exc}") from exc
            try:
                for child, vm in zip(children, vms, strict=True):
                    child.vm = vm
                    await self.mounts.mount(child)
            except ENGINE_FAILURES as exc:
                for child in children:
                    await self.kill_vm(child)
                raise OperationFailed(
                    f"mounting the volumes of the forks of {sandbox.id} failed: {exc}"
                ) from exc
            for child, vm in zip(children, vms, strict=True):
                self.attach(child, vm)
                self.table.hold(child)
                with self.table.transition(child, Op.START):
                    child.set_end(ttl)
            return children

    async def update_network(
        self, sandbox: Sandbox, allow_internet: bool | None, network: dict[str, Any]
    ) -> None:
        """Replace the running sandbox's egress rules at once; resume and fork keep them."""
        keep = {k: v for k, v in sandbox.record.network.items() if k not in ("allowOut", "denyOut")}
        merged = {**keep, **network}
        policy = egress_policy(allow_internet, merged)
        async with self.table.operation(sandbox, Op.NETWORK):
            assert sandbox.vm is not None
            try:
                await self.engine.set_policy(sandbox.vm, policy)
            except ENGINE_FAILURES as exc:
                raise OperationFailed(f"changing the network of sandbox {sandbox.id} failed: {exc}") from exc
            sandbox.record.network = merged
            sandbox.record.allow_internet = allow_internet
