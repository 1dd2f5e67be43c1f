"""One QEMU `microvm` process: its command line, its QMP monitor and its lifetime.

QEMU gets the tap and the QMP socket as inherited file descriptors, so it needs neither a
network namespace of its own nor a socket path to connect to, and no polling for a socket
to appear is needed after spawn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from qemu.qmp import QMPClient

from .accel import Accelerator

log = logging.getLogger(__name__)

QEMU_BINARY = os.environ.get("AENV_QEMU", "qemu-system-x86_64")
TCG_TRANSLATION_CACHE_MIB = 64


class MemoryMode(Enum):
    """How guest RAM is backed; it decides what a snapshot of this VM can share."""

    ANONYMOUS = "anonymous"  # plain boot, nothing to share
    SHARED_FILE = "shared-file"  # template boot: RAM lives in the file that becomes the memory image
    PRIVATE_IMAGE = "private-image"  # clone: copy-on-write mapping of an immutable memory image


@dataclass(frozen=True)
class Drive:
    """A virtio-blk disk. Order matters: it fixes the virtio-mmio slot each disk gets."""

    node: str
    path: Path
    format: str = "qcow2"
    read_only: bool = False


@dataclass(frozen=True)
class MachineConfig:
    """Everything that shapes the virtual hardware; snapshots must restore into the same shape."""

    kernel: Path
    initramfs: Path
    cmdline: str
    accel: Accelerator
    vcpus: int = 2
    memory_mib: int = 512
    drives: tuple[Drive, ...] = ()
    memory_mode: MemoryMode = MemoryMode.ANONYMOUS
    memory_path: Path | None = None
    balloon: bool = True
    mac: str = "02:00:a9:fe:00:15"

    def argv(self, *, tap_fd: int | None, qmp_fd: int, serial_log: Path, incoming: bool) -> list[str]:
        """The QEMU command line for this machine."""
        cpu = "host" if self.accel == "kvm" else "max"
        accel = "kvm" if self.accel == "kvm" else f"tcg,tb-size={TCG_TRANSLATION_CACHE_MIB}"
        argv = [
            QEMU_BINARY,
            "-M", "microvm,memory-backend=mem",
            "-accel", accel,
            "-cpu", cpu,
            "-smp", str(self.vcpus),
            "-m", f"{self.memory_mib}M",
            "-object", self._memory_backend(),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-kernel", str(self.kernel),
            "-initrd", str(self.initramfs),
            "-append", self.cmdline,
            "-chardev", f"file,id=serial,path={serial_log},append=on",
            "-serial", "chardev:serial",
            "-chardev", f"socket,id=qmp,fd={qmp_fd}",
            "-mon", "chardev=qmp,mode=control",
        ]  # fmt: skip
        for drive in self.drives:
            options = (
                f"node-name={drive.node},driver={drive.format},file.driver=file,file.filename={drive.path}"
            )
            if drive.read_only:
                options += ",read-only=on"
            argv += ["-blockdev", options, "-device", f"virtio-blk-device,drive={drive.node}"]
        if tap_fd is not None:
            argv += [
                "-netdev", f"tap,id=net0,fd={tap_fd},vhost=off",
                "-device", f"virtio-net-device,netdev=net0,mac={self.mac}",
            ]  # fmt: skip
        if self.balloon:
            argv += ["-device", "virtio-balloon-device,id=balloon0,free-page-reporting=on"]
        if incoming:
            argv += ["-incoming", "defer"]
        return argv

    def _memory_backend(self) -> str:
        size = f"size={self.memory_mib}M"
        if self.memory_mode is MemoryMode.ANONYMOUS:
            return f"memory-backend-ram,id=mem,{size}"
        if self.memory_path is None:
            raise ValueError(f"memory mode {self.memory_mode.value} needs a memory_path")
        if self.memory_mode is MemoryMode.SHARED_FILE:
            return f"memory-backend-file,id=mem,{size},mem-path={self.memory_path},share=on"
        return f"memory-backend-file,id=mem,{size},mem-path={self.memory_path},share=off,readonly=on,rom=off"


class VMError(RuntimeError):
    """QEMU failed to start, or a monitor command failed."""


@dataclass
class VirtualMachine:
    """A running QEMU process and its monitor. Create with `VirtualMachine.spawn`."""

    config: MachineConfig
    workdir: Path
    process: asyncio.subprocess.Process
    qmp: QMPClient
    spawned_at: float
    _exit_waiter: asyncio.Task[int] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def serial_log(self) -> Path:
        return self.workdir / "serial.log"

    @classmethod
    async def spawn(
        cls, config: MachineConfig, workdir: Path, *, tap_fd: int | None = None, incoming: bool = False
    ) -> VirtualMachine:
        """Start QEMU and connect its monitor. With `incoming`, it waits for migration state."""
        workdir.mkdir(parents=True, exist_ok=True)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = config.argv(
            tap_fd=tap_fd, qmp_fd=theirs.fileno(), serial_log=workdir / "serial.log", incoming=incoming
        )
        pass_fds = [theirs.fileno()] + ([tap_fd] if tap_fd is not None else [])
        started = time.monotonic()
        with open(workdir / "qemu.log", "ab") as qemu_log:
            try:
                process = await asyncio.create_subprocess_exec(
                    *argv, stdin=asyncio.subprocess.DEVNULL, stdout=qemu_log, stderr=qemu_log,
                    pass_fds=pass_fds, start_new_session=True,
                )  # fmt: skip
            finally:
                theirs.close()
        qmp = QMPClient(f"vm-{process.pid}")
        try:
            await qmp.connect(ours)
        except Exception as exc:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            raise VMError(f"QEMU exited at start: {cls._tail(workdir / 'qemu.log')}") from exc
        log.debug("QEMU %d spawned in %.1f ms", process.pid, 1000 * (time.monotonic() - started))
        return cls(config=config, workdir=workdir, process=process, qmp=qmp, spawned_at=started)

    async def command(self, name: str, **arguments: Any) -> Any:
        """Run one QMP command and return its result."""
        try:
            return await self.qmp.execute(name, arguments or None)
        except Exception as exc:
            raise VMError(f"QMP {name} failed: {exc}") from exc

    def alive(self) -> bool:
        return self.process.returncode is None

    async def wait(self, timeout: float | None = None) -> int:
        """Wait for QEMU to exit; returns its exit status."""
        return await asyncio.wait_for(self.process.wait(), timeout)

    async def kill(self) -> None:
        """Stop QEMU at once and release the monitor. Idempotent."""
        with contextlib.suppress(Exception):
            await self.qmp.disconnect()
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            await self.process.wait()

    @staticmethod
    def _tail(path: Path, limit: int = 2000) -> str:
        try:
            return path.read_text(errors="replace")[-limit:].strip() or "(no output)"
        except OSError:
            return "(no log)"
