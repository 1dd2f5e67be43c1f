"""One QEMU `microvm` process: its command line, its QMP monitor and its lifetime.

QEMU gets the tap, its main QMP socket, its recovery monitor's listening socket and its serial
console's listening socket as inherited file descriptors, so it runs in an empty network
namespace of its own, needs no polling for a socket to appear after spawn, and no right to create
files (`aenv.vmm.confine`). The node reads the console into a bounded ring (`aenv.vmm.serial`).
It runs in a session (and a PID namespace) of its own and outlives the node process; a second
monitor on a socket in its directory lets a restarted node adopt it. Exit is watched through a
pidfd, which works the same for processes this node spawned and for adopted ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from qemu.qmp import QMPClient

from . import confine, merge
from .accel import Accelerator
from .serial import SERIAL_LOG, SERIAL_SOCKET, SerialPump

log = logging.getLogger(__name__)


class _VMLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """The QMP client's log lines, each naming its VM."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"vm-{self.extra['pid']}: {msg}", kwargs


def qmp_client(pid: int) -> QMPClient:
    """A QMP client for the QEMU process `pid`. Not `QMPClient(f"vm-{pid}")`: a name makes the
    client log through a logger of its own (`qemu.qmp.qmp_client.vm-<pid>`), and the logging
    module keeps every logger it ever made, so the node grew by one logger per QEMU it started
    (found by the bench's soak). The client logs through the module's logger, naming the VM."""
    client = QMPClient()
    client.logger = _VMLog(client.logger, {"pid": pid})  # type: ignore[assignment]
    return client


QEMU_BINARY = os.environ.get("AENV_QEMU", "qemu-system-x86_64")
RECOVERY_SOCKET = "qmp.sock"
# File descriptor numbers QEMU finds its inherited sockets at.
_QMP_FD = 3
_TAP_FD = 4
_RECOVERY_FD = 5
_SERIAL_FD = 6
_MEMORY_FD = 7  # a template build's memory file, whose directory QEMU's user may not enter
# TCG's translation buffer (`-accel tcg,tb-size=`, MiB; KVM has none): QEMU reserves it whole,
# but it is host RAM only where translated code was written, and a guest that ran a workload
# fills it, so it is most of what a diverged guest's QEMU keeps beyond its guest RAM. Full, it is
# flushed and code translated again. Measured (bench divergence, 6 sandboxes that each allocate
# and free 200 MiB and write then delete 100 MiB of files; one run each, shared host): a diverged
# QEMU's private memory 99.2 MiB at 64 against 71.6 MiB at 32 (fresh: 31-34), the workload 3.7 s
# against 5.1 s, and 6.6 s at 16. A smaller buffer slows every command and still leaves a
# diverged sandbox over twice a fresh one, so 64 stays the default.
# The node sets it from `tcg_translation_cache_mib` (`set_translation_cache`).
TCG_TRANSLATION_CACHE_MIB = 64
_translation_cache_mib = TCG_TRANSLATION_CACHE_MIB


def set_translation_cache(mib: int) -> None:
    """Every TCG QEMU this process starts from now on gets a translation buffer of `mib` MiB."""
    global _translation_cache_mib
    _translation_cache_mib = mib


# microvm without the legacy PIT, PIC and RTC: the guest runs on the local APIC timer and TSC
# (and gets the wall clock from envd's /init). Under TCG the legacy timers alone cost an idle
# guest more than half of its CPU time (0.8 % of a core per idle VM with them, 0.33 % without).
MACHINE_TYPE = "microvm,pit=off,pic=off,rtc=off"
# No self-announcement after an incoming migration (QEMU's default: 5 rounds over ~1 s, each a
# RARP on the tap and, through virtio-net's guest announce, gratuitous ARP, IPv6 neighbour
# advertisements and netlink events in the guest). They tell switches a VM moved to another
# host port; a restored aenv guest sits behind a fresh tap in its own namespace that no switch
# learns, and under TCG each round is guest code a new QEMU process translates and runs right
# when a fork child or a resumed sandbox should answer its `/init`.
NO_SELF_ANNOUNCE = ("-global", "migration.announce-rounds=0")
# QEMU's whole environment: it needs none of the node's (which holds the API key and any other
# secret the node was started with), and a guest escaping into QEMU must find nothing there.
QEMU_ENVIRONMENT = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
# prctl options: a process's "no transparent huge pages" flag, inherited by its children and kept
# across execve (see `_without_huge_pages`).
_PR_SET_THP_DISABLE, _PR_GET_THP_DISABLE = 41, 42
_libc = ctypes.CDLL(None, use_errno=True)


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

    def argv(self, *, tap_fd: int | None, qmp_fd: int, workdir: Path, incoming: bool) -> list[str]:
        """The QEMU command line for this machine."""
        cpu = "host" if self.accel == "kvm" else "max"
        accel = "kvm" if self.accel == "kvm" else f"tcg,tb-size={_translation_cache_mib}"
        argv = [
            QEMU_BINARY,
            "-M", f"{MACHINE_TYPE},memory-backend=mem",
            "-accel", accel,
            "-cpu", cpu,
            "-smp", str(self.vcpus),
            "-m", f"{self.memory_mib}M",
            "-object", self._memory_backend(),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-kernel", str(self.kernel),
            "-initrd", str(self.initramfs),
            "-append", self.cmdline,
            "-chardev", f"socket,id=serial,fd={_SERIAL_FD},server=on,wait=off",
            "-serial", "chardev:serial",
            "-chardev", f"socket,id=qmp,fd={qmp_fd}",
            "-mon", "chardev=qmp,mode=control",
            "-chardev", f"socket,id=recovery,fd={_RECOVERY_FD},server=on,wait=off",
            "-mon", "chardev=recovery,mode=control",
            *NO_SELF_ANNOUNCE,
        ]  # fmt: skip
        for drive in self.drives:
            options = (
                f"node-name={drive.node},driver={drive.format},file.driver=file,file.filename={drive.path}"
            )
            if drive.read_only:
                options += ",read-only=on"
            else:
                # Space the guest frees (fstrim, discard mounts) is freed in the layer file too;
                # otherwise a sandbox's layer only ever grows. Host-side only: the device state
                # snapshots record is the same either way.
                options += ",discard=unmap,file.discard=unmap"
            argv += ["-blockdev", options, "-device", f"virtio-blk-device,drive={drive.node}"]
        if tap_fd is not None:
            argv += [
                "-netdev", f"tap,id=net0,fd={tap_fd},vhost=off",
                "-device", f"virtio-net-device,netdev=net0,mac={self.mac}",
            ]  # fmt: skip
        if self.balloon:
            # Never inflated, and without free page reporting or `deflate-on-oom`: a clone's RAM is a
            # read-only private file mapping, which QEMU's discard (behind both inflation and
            # reporting) refuses, so they would cost the guest CPU and return nothing (an inflation
            # over freed memory took 3.3-3.8 s and released no byte); memory guests free goes back
            # through `aenv.vmm.reclaim` instead, and `deflate-on-oom` only matters once inflated.
            # The device stays: every template's saved device state has it, and a restore into a
            # machine without it fails.
            argv += ["-device", "virtio-balloon-device,id=balloon0"]
        if incoming:
            argv += ["-incoming", "defer"]
        return argv

    def written_files(self) -> list[Path]:
        """The files QEMU opens for writing by name: its writable disks and a shared memory file."""
        files = [drive.path for drive in self.drives if not drive.read_only]
        if self.memory_mode is MemoryMode.SHARED_FILE and self.memory_path is not None:
            files.append(self.memory_path)
        return files

    def _memory_backend(self) -> str:
        size = f"size={self.memory_mib}M"
        if self.memory_mode is MemoryMode.ANONYMOUS:
            return f"memory-backend-ram,id=mem,{size}"
        if self.memory_path is None:
            raise ValueError(f"memory mode {self.memory_mode.value} needs a memory_path")
        if self.memory_mode is MemoryMode.SHARED_FILE:
            return f"memory-backend-file,id=mem,{size},mem-path=/proc/self/fd/{_MEMORY_FD},share=on"
        return f"memory-backend-file,id=mem,{size},mem-path={self.memory_path},share=off,readonly=on,rom=off"


class VMError(RuntimeError):
    """QEMU failed to start, or a monitor command failed."""


class QemuProcess:
    """A QEMU process watched through a pidfd; reaped here when this node spawned it.

    Its cgroup (`aenv.vmm.confine`) is deleted when it exits, the files `handed` to its `user`
    are taken back, and that uid is free for another VMM.
    """

    def __init__(
        self,
        pid: int,
        *,
        child: bool,
        confinement: confine.Confinement,
        user: confine.RuntimeUser | None,
        handed: list[Path],
    ):
        self.pid = pid
        self.user = user
        self.handed = handed
        self.returncode: int | None = None
        self._child = child
        self._confinement = confinement
        self._pidfd = os.pidfd_open(pid)
        self._loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = self._loop.create_future()
        self._loop.add_reader(self._pidfd, self._on_exit)

    def _on_exit(self) -> None:
        self._loop.remove_reader(self._pidfd)
        code = -1  # an adopted process's status belongs to its parent
        if self._child:
            with contextlib.suppress(ChildProcessError):
                _, status = os.waitpid(self.pid, 0)
                code = os.waitstatus_to_exitcode(status)
        os.close(self._pidfd)
        for path in self.handed:
            self._confinement.reclaim(path, self.user)
        self._confinement.release(self.pid, self.user)
        self.returncode = code
        self._exited.set_result(code)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)


@contextlib.contextmanager
def _without_huge_pages() -> Iterator[None]:
    """Processes spawned inside get no transparent huge pages (THP), whatever they madvise.

    A clone's guest RAM is a file mapping, which THP never backs; what THP backs in QEMU is its
    own anonymous memory (the TCG translation buffer, which QEMU madvises huge, and a few of its
    buffers), rounding each touched part up to 2 MiB. Measured with 24 idle clones under TCG
    (bench density, same run): 44.9 MiB of host RAM per sandbox instead of 46.8. The flag is the
    node's own for the instant of the spawn (the event loop spawns one process at a time), then
    restored.
    """
    if _libc.prctl(_PR_GET_THP_DISABLE, 0, 0, 0, 0) != 0:  # already off for the node itself
        yield
        return
    if _libc.prctl(_PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0:
        log.warning("cannot turn transparent huge pages off for QEMU: %s", os.strerror(ctypes.get_errno()))
        yield
        return
    try:
        yield
    finally:
        _libc.prctl(_PR_SET_THP_DISABLE, 0, 0, 0, 0)


@contextlib.contextmanager
def socket_path(directory: Path, name: str) -> Iterator[str]:
    """`directory/name` spelled short enough for a Unix socket address (at most 107 bytes),
    through a descriptor of the directory: node homes (a test's, say) can be deep."""
    fd = os.open(directory, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        os.close(fd)


def _listening(workdir: Path, name: str) -> socket.socket:
    """A Unix socket listening at `workdir/name`, for QEMU to inherit and the node to connect to."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        (workdir / name).unlink(missing_ok=True)
        with socket_path(workdir, name) as path:
            sock.bind(path)
        os.chmod(workdir / name, 0o600)
        sock.listen(1)
    except BaseException:
        sock.close()
        raise
    return sock


def _spawn(
    confinement: confine.Confinement,
    argv: list[str],
    workdir: Path,
    qmp_fd: int,
    tap_fd: int | None,
    memory: Path | None,
) -> tuple[int, socket.socket]:
    """posix_spawn QEMU in a new session with only the descriptors and environment it needs,
    as pid 1 of a PID namespace of its own (`confinement.spawning`), without transparent huge
    pages (`_without_huge_pages`) and, with memory merging on, with a fixed layout
    (`merge.fixed_layout`). Returns its pid and the node's end of its serial console.

    `argv` may start with wrappers that exec QEMU in place (`confine.Confinement.command`). The
    node opens QEMU's log (mode 0600: another VMM's uid reads it not) and binds its sockets, so
    QEMU never creates a file. The node connects to the console before QEMU runs, so QEMU accepts
    it before the guest writes a byte.
    """
    append = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    console = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.ExitStack() as stack:
        recovery = stack.enter_context(_listening(workdir, RECOVERY_SOCKET))
        serial = stack.enter_context(_listening(workdir, SERIAL_SOCKET))
        try:
            with socket_path(workdir, SERIAL_SOCKET) as path:
                console.connect(path)  # queued until QEMU accepts it
            actions: list[tuple[Any, ...]] = [
                (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                (os.POSIX_SPAWN_OPEN, 1, str(workdir / "qemu.log"), append, confine.OWNER_ONLY),
                (os.POSIX_SPAWN_DUP2, 1, 2),
                (os.POSIX_SPAWN_DUP2, qmp_fd, _QMP_FD),
                (os.POSIX_SPAWN_DUP2, recovery.fileno(), _RECOVERY_FD),
                (os.POSIX_SPAWN_DUP2, serial.fileno(), _SERIAL_FD),
            ]
            if tap_fd is not None:
                actions.append((os.POSIX_SPAWN_DUP2, tap_fd, _TAP_FD))
            if memory is not None:
                actions.append((os.POSIX_SPAWN_OPEN, _MEMORY_FD, str(memory), os.O_RDWR | os.O_CREAT, 0o644))
            with _without_huge_pages(), merge.fixed_layout(), confinement.spawning():
                pid = os.posix_spawnp(argv[0], argv, QEMU_ENVIRONMENT, file_actions=actions, setsid=True)
        except BaseException:
            console.close()
            raise
    return pid, console


@dataclass
class VirtualMachine:
    """A running QEMU process and its monitor. Create with `spawn`, or `adopt` after a restart."""

    config: MachineConfig
    workdir: Path
    process: QemuProcess
    qmp: QMPClient
    serial: SerialPump | None = None  # None: a QEMU adopted from a node that gave it a log file

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def serial_log(self) -> Path:
        return self.workdir / SERIAL_LOG

    @classmethod
    async def spawn(
        cls, config: MachineConfig, workdir: Path, *, tap_fd: int | None = None, incoming: bool = False
    ) -> VirtualMachine:
        """Start QEMU and connect its monitor. With `incoming`, it waits for migration state."""
        workdir.mkdir(parents=True, exist_ok=True)
        os.chmod(workdir, confine.PRIVATE_DIRECTORY)  # also one an earlier version made open
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = config.argv(
            tap_fd=_TAP_FD if tap_fd is not None else None, qmp_fd=_QMP_FD, workdir=workdir, incoming=incoming
        )
        confinement = confine.current()
        handed = config.written_files()
        started = time.monotonic()
        user = confinement.identity()
        try:
            shared = config.memory_path if config.memory_mode is MemoryMode.SHARED_FILE else None
            if shared is not None:
                shared.touch()  # QEMU sizes it; the node owns the name
            for path in handed:
                confinement.hand_over(path, user)
            command = confinement.command(argv, user)
            pid, console = _spawn(confinement, command, workdir, theirs.fileno(), tap_fd, shared)
        except BaseException:
            for path in handed:
                confinement.reclaim(path, user)
            confinement.give_back(user)
            raise
        finally:
            theirs.close()
        process = QemuProcess(pid, child=True, confinement=confinement, user=user, handed=handed)
        console.setblocking(False)
        serial: SerialPump | None = None
        qmp = qmp_client(process.pid)
        try:
            serial = SerialPump(workdir, console)
            # Before QEMU's monitor answers, so before the guest runs or its RAM is filled. In a
            # thread: moving a process into a cgroup waits for an RCU grace period (cgroup v1),
            # 9 % of the node loop's busy time at 256 concurrent rollouts (bench `rollout`).
            await asyncio.to_thread(confinement.enter, pid, config.vcpus, config.memory_mib)
            await qmp.connect(ours)
        except BaseException as exc:  # also cancellation (a warm-pool refill at node stop): no orphan
            process.kill()
            await asyncio.shield(process.wait())
            await serial.stop() if serial is not None else console.close()
            if not isinstance(exc, Exception):
                raise
            raise VMError(f"QEMU did not start ({exc}): {cls._tail(workdir / 'qemu.log')}") from exc
        log.debug("QEMU %d spawned in %.1f ms", process.pid, 1000 * (time.monotonic() - started))
        return cls(config=config, workdir=workdir, process=process, qmp=qmp, serial=serial)

    @classmethod
    async def adopt(cls, config: MachineConfig, workdir: Path, pid: int) -> VirtualMachine:
        """Take over a QEMU that a previous node process started, through its recovery monitor."""
        confinement = confine.current()
        handed = config.written_files()
        user = confinement.adopt(pid)
        process = QemuProcess(pid, child=False, confinement=confinement, user=user, handed=handed)
        qmp = qmp_client(pid)
        try:
            with socket_path(workdir, RECOVERY_SOCKET) as path:
                await qmp.connect(path)
        except Exception as exc:
            raise VMError(f"cannot adopt QEMU {pid}: {exc}") from exc
        with socket_path(workdir, SERIAL_SOCKET) as path:
            serial = SerialPump.connect(workdir, path)
        return cls(config=config, workdir=workdir, process=process, qmp=qmp, serial=serial)

    def move(self, workdir: Path) -> None:
        """Make `workdir` this VM's: its recovery and console sockets move there (replacing those
        of a VM it takes over from), and its console is logged there from now on."""
        for name in (RECOVERY_SOCKET, SERIAL_SOCKET):
            os.replace(self.workdir / name, workdir / name)
        if self.serial is not None:
            self.serial.move(workdir)
        self.workdir = workdir

    async def command(self, name: str, **arguments: Any) -> Any:
        """Run one QMP command and return its result."""
        try:
            return await self.qmp.execute(name, arguments or None)
        except Exception as exc:
            raise VMError(f"QMP {name} failed: {exc}") from exc

    def alive(self) -> bool:
        return self.process.returncode is None

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the QEMU process has used so far: under TCG, the guest's work."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    async def settle(self, window: float = 0.2, busy: float = 0.05, limit: float = 10.0) -> float:
        """Until the guest is idle: QEMU used at most `busy` of a core over the last `window`
        seconds, or `limit` seconds passed. Returns the seconds waited.

        A state saved while the guest still works (a connection being torn down, a timer's
        burst) makes every clone finish that work after its restore, each in a new process that
        under TCG translates the code afresh.
        """
        started = time.monotonic()
        before = self.cpu_seconds()
        while time.monotonic() - started < limit:
            await asyncio.sleep(window)
            now = self.cpu_seconds()
            if now - before <= busy * window:
                break
            before = now
        return time.monotonic() - started

    async def wait(self, timeout: float | None = None) -> int:
        """Wait for QEMU to exit; returns its exit status."""
        return await asyncio.wait_for(self.process.wait(), timeout)

    async def kill(self) -> None:
        """Stop QEMU at once and release the monitor. Idempotent."""
        with contextlib.suppress(Exception):
            await self.qmp.disconnect()
        self.process.kill()
        await self.process.wait()
        if self.serial is not None:
            await self.serial.stop()

    @staticmethod
    def _tail(path: Path, limit: int = 2000) -> str:
        """The end of a log, read from its end (a guest can make its console long)."""
        try:
            with path.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
                return f.read().decode(errors="replace").strip() or "(no output)"
        except OSError:
            return "(no log)"
