"""What a guest escaping into its QEMU process finds: no privileges, a seccomp filter, limits.

Every VMM runs as an unprivileged runtime user (`aenv-vmm` by default, created if missing),
with an empty capability bounding set and `no_new_privs` (applied by util-linux `setpriv`,
which execs QEMU in place, so the node still watches, reads and adopts QEMU's own pid), in a
root of its own holding only the files VMs need (`aenv.vmm.mountview`, joined with `nsenter`,
which also execs in place), under QEMU's seccomp sandbox with the obsolete,
privilege-raising, process-spawning and resource-control system calls denied, and in a cgroup
of its own that bounds its CPU time to its vCPUs, its memory to guest RAM plus the VMM's
measured overhead, and its thread count.

Files: the runtime user owns only what its QEMU writes through a path, its top disk layer (and
a template build's memory file), handed over at spawn and taken back (`reclaim`) when a seal
freezes that layer or the process exits; everything else it reads (memory images, lower
layers, boot files, state streams) stays the node's and read-only to it, and what it writes
otherwise (logs, device state, streams) or listens on (the recovery monitor) the node opens
and passes as file descriptors.

Cgroups: v2 (one unified tree) on modern hosts, v1 (one tree per controller) elsewhere; the
layout is detected from `/proc/self/cgroup`, and every VM's group sits below the node's own, so
whatever bounds the node also bounds its VMs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import subprocess
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SECCOMP = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
DROP_PRIVILEGES = ("setpriv", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--")
DEFAULT_USER = "aenv-vmm"
# QEMU's real group, different from its effective one (the user's group): the kernel then marks
# every VMM non-dumpable at exec, so that VMMs, which share a uid, cannot trace or read each
# other (ptrace, /proc/<pid>/mem, process_vm_readv). The overflow group grants nothing.
REAL_GROUP = 65534
KVM_DEVICE = Path("/dev/kvm")
CGROUP_ROOT = Path("/sys/fs/cgroup")
CPU_PERIOD_US = 100_000
GROUP_PREFIX = "vm-"
PROBE = "probe"
V1_CONTROLLERS = ("cpu", "memory", "pids")
# The cgroup v2 leaf the node moves itself into when its own group holds processes: v2 lets
# controllers be delegated to child groups only from a group without processes of its own.
V2_NODE_LEAF = "aenv-node"
# Present only where the kernel accounts swap per group; without it there is no swap to bound.
OPTIONAL = frozenset({"memory.swap.max"})


@dataclass(frozen=True)
class RuntimeUser:
    """The unprivileged identity of every VMM: its uid, its group and any group /dev/kvm needs."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    @classmethod
    def ensure(cls, name: str) -> RuntimeUser:
        """`name`'s identity, the user created first (a system user without home or shell) if missing."""
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            command = [
                "useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
                "--shell", "/usr/sbin/nologin", "--comment", "aenv VMMs", name,
            ]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise OSError(f"cannot create the VMM user {name}: {done.stderr.strip()}") from None
            log.warning("created the system user %s that QEMU processes run as", name)
            entry = pwd.getpwnam(name)
        if entry.pw_uid == 0:
            raise OSError(f"the VMM user {name} is root")
        kvm = KVM_DEVICE.stat().st_gid if KVM_DEVICE.exists() else None
        return cls(entry.pw_uid, entry.pw_gid, (kvm,) if kvm not in (None, 0) else ())

    def setpriv(self) -> list[str]:
        groups = f"--groups={','.join(map(str, self.groups))}" if self.groups else "--clear-groups"
        return [f"--reuid={self.uid}", f"--rgid={REAL_GROUP}", f"--egid={self.gid}", groups]


@dataclass(frozen=True)
class Limits:
    """One VM's bounds: CPU in whole vCPUs, memory in MiB, and the number of its threads."""

    vcpus: int
    memory_mib: int
    pids: int


@dataclass(frozen=True)
class CgroupTree:
    """The cgroup hierarchy (v1 or v2) where this node puts one group per VM process."""

    version: int
    # v2: the node's group; v1: the node's group in each controller's tree.
    bases: dict[str, Path]

    @classmethod
    def detect(cls, root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> CgroupTree | None:
        """The host's layout from `/proc/self/cgroup`; None when no usable controller is mounted."""
        text = Path("/proc/self/cgroup").read_text() if proc_cgroup is None else proc_cgroup
        paths: dict[str, str] = {}
        for line in text.splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                paths[controller] = path.lstrip("/")
        v1 = {c: root / c / paths[c] for c in V1_CONTROLLERS if c in paths and (root / c).is_dir()}
        if v1:
            return cls(1, v1)
        if "" in paths and (root / "cgroup.controllers").exists():
            return cls(2, {"": root / paths[""]})
        return None

    def group(self, name: str) -> dict[str, Path]:
        """The directories of one VM's group, by controller (v2: one, under the key "")."""
        return {controller: base / "aenv" / name for controller, base in self.bases.items()}

    def create(self, name: str, limits: Limits) -> None:
        """Make the VM's group and set its limits (before any process joins it)."""
        if self.version == 2:
            self._delegate_v2()
        for controller, path in self.group(name).items():
            path.mkdir(parents=True, exist_ok=True)
            for file, value in self._settings(controller, limits).items():
                if file not in OPTIONAL or (path / file).exists():
                    (path / file).write_text(value)

    def join(self, name: str, pid: int) -> None:
        """Move a process (all its threads) into the VM's group."""
        for path in self.group(name).values():
            (path / "cgroup.procs").write_text(str(pid))

    def remove(self, name: str) -> None:
        """Delete the VM's group once its process is gone; a group still in use stays."""
        for path in self.group(name).values():
            with contextlib.suppress(OSError):
                path.rmdir()

    def remove_unused(self) -> int:
        """Delete the empty VM groups earlier node processes left; returns how many."""
        removed = 0
        for base in self.bases.values():
            for path in (base / "aenv").glob(f"{GROUP_PREFIX}*"):
                with contextlib.suppress(OSError):
                    path.rmdir()
                    removed += 1
        return removed

    def _settings(self, controller: str, limits: Limits) -> dict[str, str]:
        memory = str(limits.memory_mib * 2**20)
        if self.version == 2:
            return {
                "cpu.max": f"{limits.vcpus * CPU_PERIOD_US} {CPU_PERIOD_US}",
                "memory.max": memory,
                "memory.swap.max": "0",
                "pids.max": str(limits.pids),
            }
        return {
            "cpu": {
                "cpu.cfs_period_us": str(CPU_PERIOD_US),
                "cpu.cfs_quota_us": str(limits.vcpus * CPU_PERIOD_US),
            },
            "memory": {"memory.limit_in_bytes": memory},
            "pids": {"pids.max": str(limits.pids)},
        }[controller]

    def _delegate_v2(self) -> None:
        """Enable cpu, memory and pids for the groups under `aenv/` (moving the node to a leaf if needed)."""
        base = self.bases[""]
        aenv = base / "aenv"
        if aenv.exists() and "pids" in (aenv / "cgroup.subtree_control").read_text():
            return
        procs = (base / "cgroup.procs").read_text().split()
        if procs and base != CGROUP_ROOT:
            leaf = base / V2_NODE_LEAF
            leaf.mkdir(exist_ok=True)
            for pid in procs:
                with contextlib.suppress(OSError):  # a process that exited meanwhile
                    (leaf / "cgroup.procs").write_text(pid)
        (base / "cgroup.subtree_control").write_text("+cpu +memory +pids")
        aenv.mkdir(exist_ok=True)
        (aenv / "cgroup.subtree_control").write_text("+cpu +memory +pids")


@dataclass(frozen=True)
class Confinement:
    """How this node confines every VMM it starts (see the module docstring)."""

    seccomp: bool = True
    drop_privileges: bool = True
    mount_namespace: str | None = None  # `aenv.vmm.mountview`'s, joined before anything else
    cgroups: CgroupTree | None = None
    memory_overhead_mib: int = 192
    pids: int = 256
    user: RuntimeUser | None = None  # None: QEMU stays uid 0 (without capabilities if dropped)

    def command(self, argv: list[str]) -> list[str]:
        """QEMU's command line, with its seccomp filter, behind the privilege drop and mount view."""
        if self.seccomp:
            argv = [*argv, "-sandbox", SECCOMP]
        if self.drop_privileges:
            identity = self.user.setpriv() if self.user is not None else []
            argv = [DROP_PRIVILEGES[0], *identity, *DROP_PRIVILEGES[1:], *argv]
        if self.mount_namespace is not None:
            argv = ["nsenter", f"--mount={self.mount_namespace}", "--", *argv]
        return argv

    def hand_over(self, path: Path) -> None:
        """Let the VMM user write `path` (a file its QEMU opens for writing by name)."""
        if self.user is not None:
            os.chown(path, self.user.uid, self.user.gid)

    def reclaim(self, path: Path) -> None:
        """Take `path` back from the VMM user: no QEMU can write it any more (if it is still there)."""
        if self.user is not None:
            with contextlib.suppress(FileNotFoundError):
                os.chown(path, os.getuid(), os.getgid())

    def limits(self, vcpus: int, memory_mib: int) -> Limits:
        return Limits(vcpus=vcpus, memory_mib=memory_mib + self.memory_overhead_mib, pids=self.pids)

    def enter(self, pid: int, vcpus: int, memory_mib: int) -> None:
        """Put a just-spawned QEMU into a new group of its own with its limits."""
        if self.cgroups is not None:
            name = group_name(pid)
            self.cgroups.create(name, self.limits(vcpus, memory_mib))
            self.cgroups.join(name, pid)

    def release(self, pid: int) -> None:
        """After the QEMU process `pid` exited: delete its group, and any other group left empty by
        a VM that ended unwatched (one a crashed node left, killed by pid at the next start)."""
        if self.cgroups is not None:
            self.cgroups.remove(group_name(pid))
            self.cgroups.remove_unused()


def group_name(pid: int) -> str:
    """A VM's group is named after its QEMU pid, so a restarted node finds it for an adopted VM."""
    return f"{GROUP_PREFIX}{pid}"


_current = Confinement(cgroups=None)


def install(confinement: Confinement) -> None:
    """Make `confinement` apply to every VMM this process starts from now on (the node's settings)."""
    global _current
    _current = confinement
    if confinement.cgroups is not None and (removed := confinement.cgroups.remove_unused()):
        log.info("removed %d cgroups of VMs that ended while no node was running", removed)


def current() -> Confinement:
    return _current


def from_settings(
    *,
    confine: bool,
    cgroups: bool,
    memory_overhead_mib: int,
    pids: int,
    mount_namespace: str | None,
    user: RuntimeUser | None,
) -> Confinement:
    """The node's confinement; without a writable cgroup tree, VMs run without cgroup limits (logged)."""
    tree = CgroupTree.detect() if cgroups else None
    if tree is not None:
        try:  # the node may lack the right to create groups (a container without delegation)
            tree.create(PROBE, Limits(vcpus=1, memory_mib=64, pids=16))
            tree.remove(PROBE)
        except OSError as exc:
            log.warning("cannot create cgroups (%s): VMs run without cgroup limits", exc)
            tree = None
    elif cgroups:
        log.warning("no cgroup tree with cpu, memory and pids: VMs run without cgroup limits")
    limits = {"memory_overhead_mib": memory_overhead_mib, "pids": pids}
    return Confinement(
        seccomp=confine, drop_privileges=confine, mount_namespace=mount_namespace, cgroups=tree,
        user=user if confine else None, **limits,
    )  # fmt: skip
