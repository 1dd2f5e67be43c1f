"""Boot a guest VM: upper disk layer, network namespace with a tap, QEMU, and envd ready.

This is the cold path (a full kernel boot). Templates are built this way once; sandboxes are
then restored from the template's snapshot instead of booting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..guest.artifacts import GuestArtifacts
from ..network.netns import SandboxNetwork
from .accel import Accelerator, accelerator_from_env, default_vcpus, tcg_clock_options
from .envd_link import EnvdLink
from .machine import Drive, MachineConfig, MemoryMode, VirtualMachine

log = logging.getLogger(__name__)


async def create_upper_layer(lower: Path, upper: Path, size: int | None = None) -> None:
    """A fresh writable qcow2 layer whose reads fall through to `lower`.

    With `size` (the chain's virtual size) `lower` is not opened, so it may be in use by a VM.
    A create that fails or is cancelled leaves neither the file nor qemu-img behind: the caller,
    whose await raised, never learns the file was made.
    """
    unsafe = ["-u", str(upper), str(size)] if size is not None else [str(upper)]
    process = await asyncio.create_subprocess_exec(
        "qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(lower), *unsafe,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        _, err = await process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"qemu-img create {upper} failed: {err.decode(errors='replace').strip()}")
    except BaseException:  # failed, or cancelled (a standby dropped by a kill): no qemu-img, no file
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await asyncio.shield(process.wait())
        upper.unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class BootFiles:
    """What a guest boots from besides its root disk: kernel, initramfs, tools drive, command line."""

    kernel: Path
    initramfs: Path
    tools_image: Path
    cmdline: str

    @classmethod
    def from_artifacts(
        cls, artifacts: GuestArtifacts, accel: Accelerator, hostname: str = "aenv"
    ) -> BootFiles:
        cmdline = f"{artifacts.kernel_cmdline} aenv.hostname={hostname}"
        if accel == "tcg" and (clock := tcg_clock_options()):
            cmdline += f" {clock}"
        return cls(artifacts.kernel, artifacts.initramfs, artifacts.tools_image, cmdline)


def guest_machine(
    boot: BootFiles,
    root_disk: Path,
    *,
    accel: Accelerator,
    vcpus: int = 2,
    memory_mib: int = 512,
    memory_mode: MemoryMode = MemoryMode.ANONYMOUS,
    memory_path: Path | None = None,
) -> MachineConfig:
    """The machine every aenv guest runs in: root disk first, tools drive second."""
    return MachineConfig(
        kernel=boot.kernel,
        initramfs=boot.initramfs,
        cmdline=boot.cmdline,
        accel=accel,
        vcpus=vcpus,
        memory_mib=memory_mib,
        drives=(
            Drive("root", root_disk, "qcow2"),
            Drive("tools", boot.tools_image, "raw", read_only=True),
        ),
        memory_mode=memory_mode,
        memory_path=memory_path,
    )


@dataclass
class GuestVM:
    """A booted guest with its namespace, disk layer and envd link; owns their cleanup."""

    vm: VirtualMachine
    network: SandboxNetwork
    envd: EnvdLink
    workdir: Path

    async def shutdown(self, timeout: float = 15.0) -> bool:
        """Ask the guest's init to shut down cleanly; kill QEMU if it does not exit in time.

        Returns whether the guest shut down by itself.
        """
        if self.vm.alive():
            with contextlib.suppress(Exception):
                await self.envd.run("kill -TERM 1", background=True, timeout=5)
            with contextlib.suppress(TimeoutError):
                await self.vm.wait(timeout)
        clean = not self.vm.alive()
        await self.destroy()
        return clean

    async def destroy(self, *, keep_files: bool = False) -> None:
        """Kill QEMU, remove the namespace and (unless kept) the VM directory. Idempotent."""
        self.envd.close()
        await self.vm.kill()
        await self.network.aclose()
        if not keep_files:  # in a thread too: unlinking large memory files takes a while
            await asyncio.to_thread(shutil.rmtree, self.workdir, ignore_errors=True)


async def boot_guest(
    config: MachineConfig,
    workdir: Path,
    *,
    network_name: str = "",
    network: SandboxNetwork | None = None,
    ready_timeout: float = 180.0,
) -> GuestVM:
    """Boot a guest and return once its envd answers /health.

    It runs in `network`, or else in a new namespace named `network_name`; on failure the
    namespace is destroyed either way.
    """
    started = time.monotonic()
    network = network or await SandboxNetwork.create(network_name)
    vm: VirtualMachine | None = None
    try:
        tap_fd = network.open_tap()
        try:
            vm = await VirtualMachine.spawn(config, workdir, tap_fd=tap_fd)
        finally:
            os.close(tap_fd)
        guest = GuestVM(vm=vm, network=network, envd=EnvdLink(network), workdir=workdir)
        await _wait_ready(guest, ready_timeout)
    except BaseException:
        if vm is not None:
            await vm.kill()
        network.destroy()
        raise
    log.info(
        "guest in %s booted, envd ready in %.2f s (%s)",
        network.name,
        time.monotonic() - started,
        config.accel,
    )
    return guest


async def boot_base_guest(artifacts: GuestArtifacts, workdir: Path, *, name: str, **machine: Any) -> GuestVM:
    """Boot the base root filesystem on a fresh upper layer of its own (the cold path)."""
    workdir.mkdir(parents=True, exist_ok=True)
    upper = workdir / "disk.qcow2"
    await create_upper_layer(artifacts.base_image, upper)
    accel = machine.pop("accel", None) or accelerator_from_env().accel
    machine.setdefault("vcpus", default_vcpus(accel))
    config = guest_machine(BootFiles.from_artifacts(artifacts, accel, name), upper, accel=accel, **machine)
    return await boot_guest(config, workdir, network_name=f"aenv-{name}")


async def _wait_ready(guest: GuestVM, timeout: float) -> None:
    """Wait for envd, failing fast with the serial log's tail if QEMU dies meanwhile."""
    ready = asyncio.create_task(guest.envd.wait_ready(timeout))
    exited = asyncio.create_task(guest.vm.wait())
    try:
        done, _ = await asyncio.wait({ready, exited}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (ready, exited):
            task.cancel()
    if ready in done and ready.exception() is None:
        return
    tail = VirtualMachine._tail(guest.vm.serial_log)
    cause = ready.exception() if ready in done else f"QEMU exited with status {guest.vm.process.returncode}"
    raise RuntimeError(f"guest did not become ready: {cause}; serial log ends with:\n{tail}")
