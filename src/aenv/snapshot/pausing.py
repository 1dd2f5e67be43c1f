"""Pausing a sandbox to disk, and resuming one whose stopped process was kept (parked).

A pause writes the sandbox's device state and changed pages next to its saved state, and ends
its QEMU process. With parking on (`aenv.snapshot.parking`) the process is kept instead: the
pause returns once the guest is stopped and that is recorded, the device state and pages follow
in the background, and a resume before the lot lets the process go is a `cont`. Either way the
pause reaches the disk, so the process can end at any time after that without losing anything.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import replace
from pathlib import Path

from ..events import EventBus, PauseSaved
from ..vmm import migration
from . import memory
from .clones import Clones
from .host import Host
from .model import EngineError, GuestInit, SandboxState, SandboxVM
from .parking import ParkedVM, ParkingLot, ParkingPolicy

log = logging.getLogger(__name__)

SYNC_TIMEOUT = 120.0  # a guest writing out a large page cache under TCG is slow


class Pauses:
    """Pauses sandboxes and owns the lot of parked ones (whose `release` callback it is)."""

    def __init__(self, host: Host, clones: Clones, policy: ParkingPolicy, events: EventBus):
        self.host = host
        self.clones = clones
        self.lot = ParkingLot(policy, self.release)
        # Told when a pause is wholly on this node's disk (`Handover` commits it onward).
        self.events = events

    async def pause(self, sandbox: SandboxVM, *, memory: bool = True) -> SandboxState:
        """Stop the sandbox and save it to disk; a resume continues it exactly.

        With parking on, the stopped QEMU process is kept (`_park`): the call returns once that
        is recorded, and the device state and changed pages are written right after, in the
        background. Otherwise both are written before the process ends. Without `memory`, only
        the disk is kept (`pause_disk`).
        """
        if not memory:
            return await self.pause_disk(sandbox)
        workdir = self.host.workdir(sandbox.sandbox_id)
        state = sandbox.state
        stem = f"pause-{time.time_ns()}"
        previous = [state.delta, state.devices]
        if self.lot.accepts():
            return await self._park(sandbox, workdir, stem, previous)
        async with migration.stopped(sandbox.vm, resume=False):
            devices, delta = await self.clones.capture(sandbox, workdir, stem)
        state.paused, state.devices = True, str(devices)
        state.delta, state.pid = str(delta.path), None
        state.save(workdir)
        await sandbox.guest.destroy(keep_files=True)
        self.events.publish(PauseSaved(state, sandbox.manifest))
        await asyncio.to_thread(_unlink, previous)
        return state

    async def _park(
        self, sandbox: SandboxVM, workdir: Path, stem: str, previous: list[str | None]
    ) -> SandboxState:
        """Stop the guest and keep its process, which holds the pause from then on: nothing in
        a stopped guest changes, so its state can be read after the call returns, as its pages
        always were. Until the capture is done the saved state names neither file, so a node
        restarted meanwhile finds the process through `pid` and captures it (`settle_paused`);
        the process ending before that loses the pause, as it did before its pages were written.
        """
        state = sandbox.state
        async with migration.stopped(sandbox.vm, resume=False):
            replace(state, paused=True, devices=None, delta=None).save(workdir)
        state.paused, state.devices, state.delta = True, None, None
        parked = self._start_capture(sandbox, workdir / stem, previous)
        self.lot.park(sandbox.sandbox_id, parked)
        return state

    async def pause_disk(self, sandbox: SandboxVM) -> SandboxState:
        """Keep only the sandbox's disk: the guest writes out its files, then its process ends.

        A resume boots the guest afresh from the disk (`Lifecycle.resume`): files stay, running
        processes and memory do not. The guest must answer, since it writes its own caches out.
        """
        await write_out_files(sandbox)
        await migration.stop(sandbox.vm)  # QEMU drains and flushes the disk's pending writes
        await sandbox.guest.destroy(keep_files=True)
        self.forget_memory(sandbox.state)
        self.events.publish(PauseSaved(sandbox.state, sandbox.manifest))
        return sandbox.state

    def forget_memory(self, state: SandboxState) -> None:
        """Record a sandbox as paused with its disk only, removing any memory a pause kept."""
        previous = [state.delta, state.devices]
        state.paused, state.disk_only, state.pid = True, True, None
        state.delta = state.devices = None
        state.save(self.host.workdir(state.sandbox_id))
        _unlink(previous)

    def unpark(self, sandbox_id: str) -> ParkedVM | None:
        """The sandbox's kept process, taken from the lot (a resume or kill continues or ends it)."""
        return self.lot.take(sandbox_id)

    async def drop_memory(self, sandbox_id: str) -> None:
        """Make a paused sandbox's next resume boot from its disk (E2B's resume `memory: false`)."""
        parked = self.lot.take(sandbox_id)
        if parked is not None:
            await parked.end_capture()  # the memory it would save is dropped
            await self.end_process(parked.sandbox)
        self.forget_memory(self.host.load_state(sandbox_id))

    def _start_capture(self, sandbox: SandboxVM, stem: Path, previous: list[str | None]) -> ParkedVM:
        """The parked sandbox, with its device state and changed pages being written to
        `<stem>.devices` and `<stem>.delta` in the background."""
        stop, read = threading.Event(), asyncio.Event()
        capture = asyncio.create_task(self._capture_parked(sandbox, stem, previous, stop, read))
        return ParkedVM(sandbox, capture, stop, read)

    async def _capture_parked(
        self,
        sandbox: SandboxVM,
        stem: Path,
        previous: list[str | None],
        stop: threading.Event,
        read: asyncio.Event,
    ) -> None:
        """The device state and changed pages of a parked sandbox, after its pause returned;
        never raises.

        The device state is saved first, then the pages are read into a file and flushed to the
        disk; `read` is set once the guest's state is no longer being read. A resume, kill or
        memory drop that comes first sets `stop`: the pause need not reach the disk then, so the
        reading ends early, or the files are discarded after their flush. The resume waits only
        for the reading, since the guest must not run while its state is read, and not for the
        flush (40-50 ms for 85 MiB here) nor for the removal of files (a large file's unlink
        took 25 ms). The files of the pause before it go once the sandbox no longer needs them,
        as after a capture.
        """
        devices, delta = stem.with_suffix(".devices"), stem.with_suffix(".delta")
        files = [str(devices), str(delta)]
        try:
            try:
                if not stop.is_set():
                    await migration.capture_devices(sandbox.vm, devices)
                await self.clones.capture_memory(
                    sandbox.vm.pid, sandbox.manifest, delta, sync=False, stop=stop
                )
            finally:
                read.set()
            if not stop.is_set():
                await asyncio.to_thread(memory.flush_delta, delta)
        except memory.CaptureStopped:
            pass
        except Exception as exc:  # logged, and the process kept: the pause is not on disk yet
            await asyncio.to_thread(_unlink, files)
            log.error("saving the state of paused sandbox %s failed, its process is kept: %s",
                      sandbox.sandbox_id, exc)  # fmt: skip
            return
        if stop.is_set():
            log.debug("saving the state of paused sandbox %s stopped: not needed", sandbox.sandbox_id)
            await asyncio.to_thread(_unlink, [*files, *previous])
            return
        sandbox.state.devices, sandbox.state.delta = files
        sandbox.state.save(self.host.workdir(sandbox.sandbox_id))
        self.events.publish(PauseSaved(sandbox.state, sandbox.manifest))
        await asyncio.to_thread(_unlink, previous)

    async def release(self, parked: ParkedVM) -> None:
        """End a parked sandbox's QEMU process once its pause is on disk (the lot's callback)."""
        sandbox = parked.sandbox
        await parked.capture
        if sandbox.state.delta is None:  # the capture failed: try again, and keep the process if it fails
            stem = self.host.workdir(sandbox.sandbox_id) / f"pause-{time.time_ns()}"
            retry = self._start_capture(sandbox, stem, [])
            await retry.capture
            if sandbox.state.delta is None:
                if not self.lot.closed:
                    self.lot.park(sandbox.sandbox_id, retry)
                # else: left running; the next node start captures it (`settle_paused`)
                return
        await self.end_process(sandbox)

    async def end_process(self, sandbox: SandboxVM) -> None:
        """End a paused sandbox's kept process; its pause on disk stays."""
        await sandbox.guest.destroy(keep_files=True)
        sandbox.state.pid = None
        sandbox.state.save(self.host.workdir(sandbox.sandbox_id))

    async def resume_parked(self, parked: ParkedVM, init: GuestInit) -> SandboxVM:
        """`cont` the kept process and `/init` the guest, without waiting for its pause to reach
        the disk; if that fails, the sandbox stays paused (from disk, or paused again)."""
        sandbox = parked.sandbox
        await parked.end_capture()  # the live process is the state now
        sandbox.envd.access_token = init.access_token
        try:
            await _cont_and_init(sandbox, init, self.host.workdir(sandbox.sandbox_id))
        except BaseException:
            sandbox.state.paused = True  # saved by either way out
            if sandbox.state.delta is not None or not sandbox.vm.alive():
                await self.end_process(sandbox)  # a later resume starts from the pause on disk
            else:  # the pause never reached the disk: pause again where the guest is now
                try:
                    await self.pause(sandbox)
                except Exception:  # the resume's own error is the one to report
                    log.exception("pausing %s again after a failed resume failed", sandbox.sandbox_id)
            raise
        return sandbox


async def _cont_and_init(sandbox: SandboxVM, init: GuestInit, workdir: Path) -> None:
    """`cont` a stopped guest and `/init` it. The request is sent alongside the command: it
    waits in the tap's queue until the guest runs, which saves the host a round trip with QEMU
    (~1 ms). The guest runs once `cont` is answered, and its state file says so from then on,
    written while the guest answers `/init`."""
    answered = asyncio.ensure_future(sandbox.envd.init(init.payload(reseed=False), timeout=30))
    try:
        await sandbox.vm.command("cont")
        sandbox.state.paused = False
        sandbox.state.save(workdir)
    except BaseException:
        answered.cancel()  # it closes its connection as it ends
        raise
    await answered


async def write_out_files(sandbox: SandboxVM) -> None:
    """Have the guest write its cached file changes to its disk, before only the disk is kept."""
    code = await sandbox.envd.run("sync", timeout=SYNC_TIMEOUT)
    if code != 0:
        raise EngineError(f"writing out the files of sandbox {sandbox.sandbox_id} failed (sync: {code})")


def _unlink(paths: list[str | None]) -> None:
    """Remove the files of an earlier pause that a newer one replaced."""
    for path in paths:
        if path:
            Path(path).unlink(missing_ok=True)
