"""Saving and loading a running VM's state over QMP: the only place these sequences are spelled out.

Guest RAM never travels through the migration stream: templates boot with RAM in a shared file
(the memory image) and clones map that image, so every stream is written and read with
`x-ignore-shared` and carries only headers and device sections (see `aenv.vmm.devstate`).
Changed pages are captured separately from `/proc` (`aenv.snapshot.memory`). Each function
here is one step the snapshot engine and the benchmark floors compose:

- `save`: a template's full stream (without RAM) and its device sections alone, the VM stopped;
- `capture_devices`: a stopped sandbox's device sections (pause, snapshot);
- `seal_disk`: the top of a running disk chain frozen under a new writable layer (snapshot),
  and `unseal_disk`, its undo (a snapshot that failed): the new layer committed back into it;
- `prepare_incoming` + `load`: a QEMU started with `-incoming defer` fed a spliced stream until
  its guest runs (start, resume, warm VMs).

QEMU runs as an unprivileged user that may create no file (`aenv.vmm.confine`): the files it
saves into and loads from are opened by the node and passed over QMP, and a sealed layer's successor is
created by the node, handed to QEMU's user, and the sealed layer taken back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path

from . import confine
from .launcher import create_upper_layer
from .machine import VirtualMachine, VMError

_IGNORE_SHARED = [{"capability": "x-ignore-shared", "state": True}]
# fd set ids for the files passed to QEMU: above the few a QEMU's command line uses (the serial
# log's is 1), below 2^31 (QEMU parses `/dev/fdset/N` as an int).
_FDSET_FIRST, _FDSET_IDS = 1 << 16, 1 << 30


class MigrationError(VMError):
    """QEMU did not save or load a VM's state; the message says which and why."""


async def prepare_incoming(vm: VirtualMachine) -> None:
    """Make a QEMU waiting for incoming state (`-incoming defer`) keep its mapped memory image."""
    await vm.command("migrate-set-capabilities", capabilities=_IGNORE_SHARED)


async def _pass_file(vm: VirtualMachine, path: Path, flags: int, name: str) -> None:
    """Open `path` (a new file: the node's alone) and hand QEMU the descriptor as `name` (QMP `getfd`)."""
    fd = os.open(path, flags, confine.OWNER_ONLY)
    try:
        vm.qmp.send_fd_scm(fd)
        await vm.command("getfd", fdname=name)
    finally:
        os.close(fd)


async def load(vm: VirtualMachine, stream: Path, timeout: float) -> None:
    """Feed a prepared QEMU the stream, wait for the load, and let the guest run.

    The node opens the stream and passes it (QMP `getfd`; `migrate-incoming` takes the
    descriptor over): a resume's stream lies in the sandbox's own directory, which no QEMU sees.
    """
    await _pass_file(vm, stream, os.O_RDONLY, "incoming")
    await vm.command("migrate-incoming", uri="fd:incoming")
    deadline = time.monotonic() + timeout
    while (status := (await vm.command("query-status"))["status"]) == "inmigrate":
        if time.monotonic() > deadline:
            raise MigrationError("loading the device state timed out")
        await asyncio.sleep(0.001)
    if status == "paused":
        await vm.command("cont")
    elif status != "running":  # QEMU starts the guest by itself once the state is loaded
        raise MigrationError(f"loading the device state failed: QEMU is {status}")


async def save(vm: VirtualMachine, stream: Path, devices: Path) -> None:
    """With the guest stopped and its RAM in a shared file: the stream without RAM, then its devices.

    The stream's prefix (everything before the device sections) is what every later state of
    a clone is spliced onto; the device file is how that prefix is found in it.
    """
    await vm.command("migrate-set-capabilities", capabilities=_IGNORE_SHARED)
    await _pass_file(vm, stream, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "stream")
    await vm.command("migrate", uri="fd:stream")
    while True:
        status = (await vm.command("query-migrate")).get("status")
        if status == "completed":
            break
        if status in ("failed", "cancelled"):
            raise MigrationError(f"saving the VM's state failed ({status})")
        await asyncio.sleep(0.002)
    await capture_devices(vm, devices)


async def capture_devices(vm: VirtualMachine, devices: Path) -> None:
    """With the guest stopped: its device sections alone (no RAM), as `migrate-incoming` reads them.

    The node opens the file and passes it to QEMU in an fd set whose id it picks (at random, so
    that no set left behind by an earlier node process is reused). Knowing the id beforehand,
    it sends the three commands (add the file to the set, save into it, remove the set) at once:
    QEMU runs a monitor's commands in the order they came, and they cost one round trip instead
    of three (each is ~0.45 ms through the QMP client here, against 0.1 ms on a raw socket).
    """
    fdset = secrets.randbelow(_FDSET_IDS) + _FDSET_FIRST
    fd = os.open(devices, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, confine.OWNER_ONLY)
    try:
        vm.qmp.send_fd_scm(fd)
        added, saved, _ = await asyncio.gather(
            vm.command("add-fd", **{"fdset-id": fdset}),
            vm.command("xen-save-devices-state", filename=f"/dev/fdset/{fdset}", live=False),
            vm.command("remove-fd", **{"fdset-id": fdset}),  # fails only where add-fd did
            return_exceptions=True,
        )
    finally:
        os.close(fd)
    for outcome in (added, saved):
        if isinstance(outcome, BaseException):
            raise outcome


async def stop(vm: VirtualMachine) -> None:
    """Stop the guest's CPUs, so that nothing changes while its state is read."""
    await vm.command("stop")


async def cont(vm: VirtualMachine) -> None:
    """Let a stopped guest run again; a QEMU that is gone by now is no error here."""
    with contextlib.suppress(VMError):
        await vm.command("cont")


@contextlib.asynccontextmanager
async def stopped(vm: VirtualMachine, *, resume: bool) -> AsyncIterator[None]:
    """The guest stopped for a capture; it runs again afterwards if `resume`, else only on failure."""
    await stop(vm)
    try:
        yield
    except BaseException:
        await cont(vm)
        raise
    if resume:
        await cont(vm)


async def seal_disk(vm: VirtualMachine, node: str, new_file: Path, new_node: str) -> None:
    """Freeze the disk chain's top (`node`) under a new writable qcow2 layer at `new_file`.

    The old top is never written again, so a snapshot of the disk costs no copy; the new layer
    records the old one's absolute path as its backing file. The node creates it and hands it
    to that QEMU's uid, and takes the old top back, so no QEMU can write a sealed layer.
    """
    nodes = await vm.command("query-named-block-nodes", flat=True)
    top = next(info for info in nodes if info.get("node-name") == node)
    old_file = Path(top["file"])
    await create_upper_layer(old_file, new_file, size=top["image"]["virtual-size"])
    confinement, user = confine.current(), vm.process.user
    try:
        confinement.hand_over(new_file, user)
        await vm.command(
            "blockdev-snapshot-sync",
            **{
                "node-name": node,
                "snapshot-file": str(new_file),
                "snapshot-node-name": new_node,
                "format": "qcow2",
                "mode": "existing",
            },
        )
    except BaseException:
        new_file.unlink(missing_ok=True)
        raise
    vm.process.handed = [*(path for path in vm.process.handed if path != old_file), new_file]
    confinement.reclaim(old_file, user)


JOB_POLL = 0.05  # seconds between looks at a block job (a rollback's commit is short)


async def unseal_disk(vm: VirtualMachine, node: str, base_file: Path) -> tuple[str, Path]:
    """Undo `seal_disk`: commit the writable top (`node`) into the layer below it (at
    `base_file`), which becomes the writable top again; returns that layer's node name and the
    old top's file, now unused.

    What the guest wrote since the seal moves down (an active `block-commit`, completed with a
    pivot); the chain reads the same at every moment, so a commit interrupted by the VM's end
    leaves both layers consistent. QEMU reopens the base for writing by name: it is handed back
    to QEMU's user first.
    """
    nodes = await vm.command("query-named-block-nodes", flat=True)
    top = next(info for info in nodes if info.get("node-name") == node)
    top_file, backing = Path(top["file"]), top["image"].get("full-backing-filename")
    if backing is None or Path(backing).name != base_file.name:
        raise VMError(f"disk layer {base_file.name} is not right below {top_file.name}")
    base = next(i["node-name"] for i in nodes if i.get("drv") == "qcow2" and i.get("file") == backing)
    confinement, user = confine.current(), vm.process.user
    confinement.hand_over(base_file, user)
    job = f"unseal-{node}"
    try:
        commit = {"job-id": job, "device": node, "top-node": node, "base-node": base}
        await vm.command("block-commit", **commit)
        await _job_reached(vm, job, ready=True)
        await vm.command("job-complete", id=job)
        await _job_reached(vm, job, ready=False)
        nodes = await vm.command("query-named-block-nodes", flat=True)
        if any(info.get("node-name") == node for info in nodes):
            raise VMError(f"committing disk layer {top_file.name} down did not complete")
    except BaseException:
        confinement.reclaim(base_file, user)
        raise
    vm.process.handed = [*(path for path in vm.process.handed if path != top_file), base_file]
    confinement.reclaim(top_file, user)
    return base, top_file


async def _job_reached(vm: VirtualMachine, job: str, *, ready: bool) -> None:
    """Wait until the block job is ready to complete (`ready`) or gone; an error if it failed."""
    while True:
        jobs = {info["device"]: info for info in await vm.command("query-block-jobs")}
        info = jobs.get(job)
        if info is None and ready:
            raise VMError(f"block job {job} ended before it was ready")
        if info is not None and info.get("error"):
            raise VMError(f"block job {job} failed: {info['error']}")
        if (info is None) if not ready else info.get("ready"):
            return
        await asyncio.sleep(JOB_POLL)
