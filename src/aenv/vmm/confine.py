"""What a guest escaping into its QEMU process finds: no privileges, a seccomp filter, limits.

Every VMM runs as an unprivileged uid of its own (`VmmIdentities`: one per VM from a range
reserved in the settings, with a group of the same number and no /etc/passwd entry), so a
QEMU a guest took over can neither signal another VM's QEMU nor open its files. It has an
empty capability bounding set and `no_new_privs` (applied by util-linux `setpriv`, which execs
QEMU in place, so the node still watches, reads and adopts QEMU's own pid), a root of its own
holding only the files VMs need (`aenv.vmm.mountview`, joined with `nsenter`, which also execs
in place), namespaces of its own (`Confinement.spawning`: it is pid 1 of a PID namespace, with a
/proc of that namespace, in an empty network namespace: it sees no other process and reaches no
address, its tap being a descriptor), QEMU's seccomp sandbox with the obsolete,
privilege-raising, process-spawning and resource-control system calls denied, and a cgroup of
its own that bounds its CPU time to its vCPUs, its memory to guest RAM plus the VMM's measured
overhead, and its thread count.

Files: a VMM's uid owns only what its QEMU writes through a path, its top disk layer (and a
template build's memory file), handed over at spawn (mode 0600: no other VMM reads it either)
and taken back (`reclaim`) when a seal freezes that layer or the process exits; everything
else it reads (memory images, sealed layers, boot files, state streams) stays the node's and
read-only to it, and what it writes otherwise (logs, device state, streams), loads (a start's or
resume's device state) or listens on (the recovery monitor) the node opens and passes as file
descriptors. A VM's own directory (`PRIVATE_DIRECTORY`) is not in its view. `/dev/kvm` it opens through
the device's group, which every VMM gets as a supplementary group.

Cgroups: v2 (one unified tree) on modern hosts, v1 (one tree per controller) elsewhere; the
layout is detected from `/proc/self/cgroup`, and every VM's group sits below the node's own, so
whatever bounds the node also bounds its VMs.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pwd
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SECCOMP = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
DROP_PRIVILEGES = ("setpriv", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--")
# An empty network namespace and a mount namespace (a copy of the view) with a /proc of QEMU's own
# PID namespace; util-linux `unshare` execs in place, as root, before the privilege drop.
NAMESPACES = ("unshare", "--net", "--mount-proc", "--")
CLONE_NEWPID = 0x20000000
# QEMU's real group, different from its effective one (its own group): the kernel then marks
# every VMM non-dumpable at exec, so that no process of another uid without privileges (and no
# other VMM) traces or reads it (ptrace, /proc/<pid>/mem, process_vm_readv). The overflow group
# grants nothing.
REAL_GROUP = 65534
KVM_DEVICE = Path("/dev/kvm")
CGROUP_ROOT = Path("/sys/fs/cgroup")
CPU_PERIOD_US = 100_000
GROUP_PREFIX = "vm-"
PROBE = "probe"
V1_CONTROLLERS = ("cpu", "memory", "pids")
V1_SHARES, V1_MIN_SHARES = 1024, 2  # cgroup v1's `cpu.shares` of a nice-0 task, and its least
# The cgroup v2 leaf the node moves itself into when its own group holds processes: v2 lets
# controllers be delegated to child groups only from a group without processes of its own.
V2_NODE_LEAF = "aenv-node"
# Present only where the kernel accounts swap per group; without it there is no swap to bound.
OPTIONAL = frozenset({"memory.swap.max"})
OWNER_ONLY = 0o600  # a handed file's mode: its VMM reads and writes it, no other VMM opens it
# A VM's directory (`sandboxes/<id>`, a warm VM's, a build's): the node's alone. QEMU opens nothing
# in it by name (its logs, sockets, device state and streams are descriptors the node passes).
PRIVATE_DIRECTORY = 0o700
# The disk layers' directory: a VMM opens the layers of its own chain, whose names it is given, but
# lists none (a paused sandbox's sealed top, say, whose name no other VMM can learn).
UNLISTED = 0o711
UID_MAX = 2**31 - 1  # uids past this confuse tools that read them as signed


class IdentityError(OSError):
    """No uid is free for another VMM, or the configured range clashes with the host's users."""


@dataclass(frozen=True)
class RuntimeUser:
    """The unprivileged identity of one VMM: its uid, its group and any group /dev/kvm needs."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    def setpriv(self) -> list[str]:
        groups = f"--groups={','.join(map(str, self.groups))}" if self.groups else "--clear-groups"
        return [f"--reuid={self.uid}", f"--rgid={REAL_GROUP}", f"--egid={self.gid}", groups]


class VmmIdentities:
    """The uids VMMs run as, one per running QEMU, from `first` to `first + count - 1`.

    A uid (and the group of the same number) is taken at spawn and given back when that QEMU
    exits; the next spawn takes the next free one after the last taken, so a uid is reused as
    late as possible. The range must hold no user of the host (`check_unused`): nothing but
    these VMMs may run as, or own files as, one of its uids.
    """

    def __init__(self, first: int, count: int, groups: tuple[int, ...] | None = None):
        if first <= 0 or count < 1 or first + count - 1 > UID_MAX:
            raise IdentityError(f"VMM uid range {first}..{first + count - 1} is out of bounds")
        self.first, self.count = first, count
        self.groups = kvm_groups() if groups is None else groups
        self._taken: set[int] = set()
        self._next = first

    def check_unused(self) -> None:
        """Refuse a range that holds a user of this host (its files or processes would be exposed)."""
        last = self.first + self.count - 1
        clash = [entry.pw_name for entry in pwd.getpwall() if self.first <= entry.pw_uid <= last]
        if clash:
            raise IdentityError(
                f"the VMM uid range {self.first}..{last} holds host users "
                f"({', '.join(clash[:3])}): choose another vmm_uid_base"
            )

    def take(self) -> RuntimeUser:
        for offset in range(self.count):
            uid = self.first + (self._next - self.first + offset) % self.count
            if uid not in self._taken:
                self._taken.add(uid)
                self._next = self.first + (uid - self.first + 1) % self.count
                return RuntimeUser(uid, uid, self.groups)
        raise IdentityError(f"all {self.count} VMM uids are in use")

    def adopt(self, pid: int) -> RuntimeUser | None:
        """The identity a running QEMU (started by an earlier node process) has, marked taken."""
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        except (OSError, ValueError):
            return None
        uid = int(fields["Uid"].split()[0])
        if not self.first <= uid < self.first + self.count:
            return None
        self._taken.add(uid)
        return RuntimeUser(uid, int(fields["Gid"].split()[1]), self.groups)

    def give_back(self, user: RuntimeUser) -> None:
        self._taken.discard(user.uid)

    def in_use(self) -> int:
        return len(self._taken)


def kvm_groups() -> tuple[int, ...]:
    """The supplementary group that opens /dev/kvm (its group), if there is one but root's."""
    kvm = KVM_DEVICE.stat().st_gid if KVM_DEVICE.exists() else None
    return (kvm,) if kvm not in (None, 0) else ()


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

    def weigh(self, weight: int) -> None:
        """Give the VMs' parent group (`aenv/`) CPU `weight` against the node's 100, when both want
        more CPU than there is (v2 `cpu.weight`; v1 `cpu.shares`, 1024 per 100).

        The node's threads sit beside that group (in the node's group, or its v2 leaf), each
        weighing 100 (nice 0), and the VMs split the group's weight among themselves by their own
        (equal) weights, each still bounded to its vCPUs: so the weight decides how long the node
        waits for a CPU on a host that its VMs keep busy, and nothing between VMs.
        """
        if self.version == 2:
            self._delegate_v2()
            (self.bases[""] / "aenv" / "cpu.weight").write_text(str(weight))
        elif "cpu" in self.bases:
            parent = self.bases["cpu"] / "aenv"
            parent.mkdir(parents=True, exist_ok=True)
            (parent / "cpu.shares").write_text(str(max(V1_MIN_SHARES, weight * V1_SHARES // 100)))

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
        """Delete the empty VM groups earlier node processes left; returns how many.

        A group whose process is alive stays even when empty: it was just made for a QEMU that
        has not joined it yet (this node's, or another node's on the host, which share the
        parent), and removing it would fail that VM's start.
        """
        removed = 0
        for base in self.bases.values():
            for path in (base / "aenv").glob(f"{GROUP_PREFIX}*"):
                pid = path.name.removeprefix(GROUP_PREFIX)
                if pid.isdigit() and _running(int(pid)):
                    continue
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
    identities: VmmIdentities | None = None  # None: QEMU stays uid 0 (without capabilities if dropped)
    namespaces: bool = True  # QEMU in PID, network and mount namespaces of its own (`spawning`)

    def identity(self) -> RuntimeUser | None:
        """A uid for a QEMU about to start (give it back with `release` once it exited)."""
        return self.identities.take() if self.identities is not None else None

    def adopt(self, pid: int) -> RuntimeUser | None:
        """The uid of a QEMU an earlier node process started (kept from other VMMs until it exits)."""
        return self.identities.adopt(pid) if self.identities is not None else None

    def command(self, argv: list[str], user: RuntimeUser | None = None) -> list[str]:
        """QEMU's command line, with its seccomp filter, behind the privilege drop (to `user`), its
        namespaces and the mount view (spawn it inside `spawning`)."""
        if self.seccomp:
            argv = [*argv, "-sandbox", SECCOMP]
        if self.drop_privileges:
            identity = user.setpriv() if user is not None else []
            argv = [DROP_PRIVILEGES[0], *identity, *DROP_PRIVILEGES[1:], *argv]
        if self.namespaces:
            argv = [*NAMESPACES, *argv]
        if self.mount_namespace is not None:
            argv = ["nsenter", f"--mount={self.mount_namespace}", "--", *argv]
        return argv

    @contextlib.contextmanager
    def spawning(self) -> Iterator[None]:
        """The one process this thread spawns inside is pid 1 of a new PID namespace.

        QEMU (`command` execs in place down to it) is then that namespace's only process: it sees
        no other process in its /proc, and the node keeps its host pid to wait on, signal (SIGKILL,
        which pid 1 cannot ignore from an ancestor namespace) and read `/proc/<pid>/mem` of. No
        init is needed: QEMU's seccomp filter forbids it children, so it has none to reap, and
        the namespace ends with it. A thread's namespace for children is its own (the node's
        other threads are unaffected) and is set back right after (four system calls per spawn).
        """
        if not self.namespaces:
            yield
            return
        own = os.open("/proc/thread-self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _namespace_call(_libc.unshare(CLONE_NEWPID), "unshare a PID namespace")
            try:
                yield
            finally:
                _namespace_call(_libc.setns(own, CLONE_NEWPID), "return to the node's PID namespace")
        finally:
            os.close(own)

    @staticmethod
    def hand_over(path: Path, user: RuntimeUser | None) -> None:
        """Let one VMM (`user`) read and write `path` (a file its QEMU opens by name), and no other."""
        if user is not None:
            os.chown(path, user.uid, user.gid)
            os.chmod(path, OWNER_ONLY)

    @staticmethod
    def reclaim(path: Path, user: RuntimeUser | None) -> None:
        """Take `path` back from its VMM: no QEMU can open it any more (if it is still there)."""
        if user is not None:
            with contextlib.suppress(FileNotFoundError):
                os.chown(path, os.getuid(), os.getgid())

    def limits(self, vcpus: int, memory_mib: int) -> Limits:
        return Limits(vcpus=vcpus, memory_mib=memory_mib + self.memory_overhead_mib, pids=self.pids)

    def enter(self, pid: int, vcpus: int, memory_mib: int) -> None:
        """Put a just-spawned QEMU into a new group of its own with its limits."""
        if self.cgroups is None:
            return
        name = group_name(pid)
        self.cgroups.create(name, self.limits(vcpus, memory_mib))
        self.cgroups.join(name, pid)

    def give_back(self, user: RuntimeUser | None) -> None:
        """`user`'s QEMU exited (or never started): its uid is free for another VMM."""
        if user is not None and self.identities is not None:
            self.identities.give_back(user)

    def release(self, pid: int, user: RuntimeUser | None) -> None:
        """After the QEMU process `pid` exited: give its uid back and delete its group, and any
        other group left empty by a VM that ended unwatched (one a crashed node left, killed by
        pid at the next start)."""
        self.give_back(user)
        if self.cgroups is not None:
            self.cgroups.remove(group_name(pid))
            self.cgroups.remove_unused()


_libc = ctypes.CDLL(None, use_errno=True)


def _namespace_call(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"cannot {what}: {os.strerror(errno)}")


def _running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (an unreaped zombie has: a QEMU whose node
    was killed is reparented, and its reaper may be slow or absent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


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
    identities: VmmIdentities | None,
    cpu_weight: int,
) -> Confinement:
    """The node's confinement; without a writable cgroup tree, VMs run without cgroup limits (logged).
    `cpu_weight`: the VMs' together, against the node's 100 (`CgroupTree.weigh`)."""
    tree = CgroupTree.detect() if cgroups else None
    if tree is not None:
        try:  # the node may lack the right to create groups (a container without delegation)
            tree.create(PROBE, Limits(vcpus=1, memory_mib=64, pids=16))
            tree.remove(PROBE)
        except OSError as exc:
            log.warning("cannot create cgroups (%s): VMs run without cgroup limits", exc)
            tree = None
    if tree is not None:
        try:
            tree.weigh(cpu_weight)
        except OSError as exc:  # the limits hold without it: the VMs keep the default weight
            log.warning("cannot set the VMs' CPU weight (%s): they weigh as the node", exc)
    elif cgroups:
        log.warning("no cgroup tree with cpu, memory and pids: VMs run without cgroup limits")
    limits = {"memory_overhead_mib": memory_overhead_mib, "pids": pids}
    return Confinement(
        seccomp=confine, drop_privileges=confine, mount_namespace=mount_namespace, cgroups=tree,
        identities=identities if confine else None, namespaces=confine, **limits,
    )  # fmt: skip
