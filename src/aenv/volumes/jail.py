"""Start one sandbox's volume server (diod) confined: `python -m aenv.volumes.jail SPEC`.

The node runs this as root inside the sandbox's network namespace; it builds the server's
world and execs diod in place (so the node's process handle is diod's). What diod then has:

* **No privilege on the host.** It runs as root of a user namespace of its own whose uids and
  gids 0..count-1 are the host's `base`..`base+count-1` (a range holding no host user), so the
  uid a guest claims over 9P (diod trusts it: `-n -N`) only ever becomes one of those host
  uids, and the capabilities it holds are over that namespace only: no `CAP_MKNOD`, no mount,
  no raw I/O in the host's. The maps are written by a helper process that stays in the host's
  namespace (a process cannot map more than its own uid into the namespace it just made).
* **A root holding only what it serves.** A new mount namespace (owned by the host's user
  namespace, so diod can neither mount nor unmount in it) whose root, after `pivot_root`, is
  a small read-only tmpfs with diod, its ELF interpreter and the libraries it links
  (read-only binds of those files alone, found with `ldd`: no host `/usr`), two files of
  `/etc`, and the sandbox's volumes under `/v/<name>`, each bound `nodev,nosuid,noexec`: a
  device node on a volume cannot be opened, whatever made it. There is no `/proc`, `/sys` or
  `/dev`.
* **A seccomp filter** refusing (EPERM) what a file server never needs and what widens the
  kernel's surface: new namespaces, mounts, `chroot`, `pivot_root`, tracing, BPF, keyrings,
  kernel modules, handles by inode, io_uring, and creating device nodes.
* **A cgroup** (v1 hosts: devices and pids controllers) that denies every device and bounds
  its threads. On a cgroup-v2-only host the device denial is the two points above: device
  nodes can be neither created (no `CAP_MKNOD` in the host's namespace, and the filter) nor
  opened (`nodev`).

It binds the 9P port (564, below 1024) without `CAP_NET_BIND_SERVICE` over the network
namespace: the namespace's `ip_unprivileged_port_start` is lowered to that port first. Only
this server and the node listen in a sandbox's namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pyseccomp

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
# CLONE_NEW{NS,CGROUP,UTS,IPC,USER,PID,NET,TIME}
NAMESPACE_FLAGS = (0x20000, 0x2000000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000, 0x80)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
S_IFCHR, S_IFBLK, S_IFMT = 0o020000, 0o060000, 0o170000
CGROUP_V1 = Path("/sys/fs/cgroup")
CGROUP_PARENT = "aenv-volumes"
PIDS_MAX = 256
SERVER = "/diod"
LIBRARIES = "/lib"
DENIED = (
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "ptrace", "process_vm_readv",
    "process_vm_writev", "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon",
    "swapoff", "syslog", "open_by_handle_at", "name_to_handle_at", "fsopen", "fsmount", "fsconfig",
    "fspick", "move_mount", "open_tree", "mount_setattr", "quotactl", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "kcmp", "acct", "iopl", "ioperm", "settimeofday", "clock_settime", "adjtimex",
)  # fmt: skip
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class Spec:
    """What the node asks for: where to build the root, what to export, where to listen, as whom."""

    root: str  # an empty directory of the node's (its mount point in the server's namespace)
    exports: dict[str, str]  # 9P export path (/v/<name>) -> the volume's data directory
    files: dict[str, str]  # the server's binary and libraries (`server_files`)
    listen: str  # ADDRESS:PORT
    uid_base: int
    uid_count: int
    cgroup: str  # the name of the server's own group (under aenv-volumes/)


def _check(result: int, what: str) -> None:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _bytes(value: str | None) -> bytes | None:
    return value.encode() if value is not None else None


def _mount(source: str | None, target: str, kind: str | None, flags: int, data: str | None = None) -> None:
    result = _libc.mount(_bytes(source), target.encode(), _bytes(kind), ctypes.c_ulong(flags), _bytes(data))
    _check(result, f"mount {source} on {target}")


def _bind(source: str, target: str, flags: int) -> None:
    """Bind `source` (not what is mounted below it) on `target`, then apply `flags` to the bind."""
    _mount(source, target, None, MS_BIND)
    _mount(None, target, None, MS_BIND | MS_REMOUNT | flags)


CGROUP_SETTINGS = {"devices": ("devices.deny", "a"), "pids": ("pids.max", str(PIDS_MAX))}


def cgroup_dirs(name: str) -> dict[str, Path]:
    """The server's group in each cgroup-v1 controller it uses that the host has, by controller."""
    found = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in CGROUP_SETTINGS:
            if controller in controllers.split(",") and (CGROUP_V1 / controller).is_dir():
                found[controller] = CGROUP_V1 / controller / path.lstrip("/") / CGROUP_PARENT / name
    return found


def remove_unused_groups() -> None:
    """Delete the groups of servers that have exited (a node killed before it removed them); a
    group whose server runs stays (the kernel refuses to remove it)."""
    for parent in {group.parent for group in cgroup_dirs("-").values()}:
        for group in parent.glob("*") if parent.is_dir() else ():
            if group.is_dir():
                with contextlib.suppress(OSError):
                    group.rmdir()


def _enter_cgroup(name: str) -> None:
    """Join the server's groups; where groups cannot be made (a container without delegation) it
    runs without them, said in the node's log, as VMs do (`aenv.vmm.confine`): the device denial
    still holds through `nodev` and the missing `CAP_MKNOD`."""
    for controller, group in cgroup_dirs(name).items():
        file, value = CGROUP_SETTINGS[controller]
        try:
            group.mkdir(parents=True, exist_ok=True)
            (group / file).write_text(value)
            (group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError as exc:
            print(f"running without a {controller} cgroup: {exc}", file=sys.stderr, flush=True)


def server_files(binary: str) -> dict[str, str]:
    """The files the server's root holds, by their path there: `binary` (as `/diod`), the ELF
    interpreter it names and the libraries it links (found once by the node with `ldd`, which
    costs ~10 ms: not at every start)."""
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    files = {SERVER: os.path.realpath(binary)}
    for line in out.splitlines():
        words = line.split()
        if "=>" in words and len(words) > 2 and words[2].startswith("/"):
            files[f"{LIBRARIES}/{Path(words[2]).name}"] = os.path.realpath(words[2])
        elif words and words[0].startswith("/"):
            files[words[0]] = os.path.realpath(words[0])
    return files


def _build_root(spec: Spec) -> None:
    """The server's root: a tmpfs with diod, its libraries, /etc and the volumes (see the docstring)."""
    root = spec.root
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("aenv-volume-server", root, "tmpfs", MS_NODEV | MS_NOSUID | MS_NOEXEC, "mode=0755,size=1m")
    for inner, host in spec.files.items():
        target = Path(root + inner)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
        _bind(host, str(target), MS_RDONLY | MS_NODEV | MS_NOSUID)
    etc = Path(root, "etc")
    etc.mkdir()
    # diod names each client (getnameinfo): from files only, never a DNS query that fails.
    (etc / "nsswitch.conf").write_text("hosts: files\n")
    (etc / "hosts").write_text("127.0.0.1 localhost\n")
    for export, data in spec.exports.items():
        target = Path(root + export)
        target.mkdir(parents=True)
        _bind(data, str(target), MS_NODEV | MS_NOSUID | MS_NOEXEC)
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NODEV | MS_NOSUID | MS_NOEXEC)
    os.chdir(root)
    _check(_libc.syscall(SYS_PIVOT_ROOT[os.uname().machine], b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detach the host's root")
    os.chdir("/")


def _map_helper(spec: Spec) -> tuple[int, int]:
    """A child left in the host's namespaces (forked before this process leaves them) that writes
    this process's uid and gid maps once told its user namespace exists: a process cannot map more
    than its own uid into the namespace it made. Returns its pid and the pipe that tells it."""
    ready_r, ready_w = os.pipe()
    helper = os.fork()
    if helper == 0:
        os.close(ready_w)
        code = 1
        try:
            if os.read(ready_r, 1) == b"u":
                for kind in ("uid_map", "gid_map"):
                    Path(f"/proc/{os.getppid()}/{kind}").write_text(f"0 {spec.uid_base} {spec.uid_count}\n")
                code = 0
        finally:
            os._exit(code)
    os.close(ready_r)
    return helper, ready_w


def _enter_user_namespace(helper: int, ready: int) -> None:
    """Become root of a new user namespace mapping 0..count-1 onto the host's base.. (by `helper`)."""
    _check(_libc.unshare(CLONE_NEWUSER), "unshare the user namespace")
    os.write(ready, b"u")
    os.close(ready)
    _, status = os.waitpid(helper, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise OSError(errno.EPERM, "the user namespace's uid and gid maps could not be written")
    os.setgroups([])
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)


def _seccomp() -> None:
    rules = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    refuse = pyseccomp.ERRNO(errno.EPERM)
    for name in DENIED:
        rules.add_rule(refuse, name)
    for flag in NAMESPACE_FLAGS:  # threads yes, namespaces no
        rules.add_rule(refuse, "clone", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, flag, flag))
    rules.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")  # its flags are in memory: glibc falls back
    for kind in (S_IFCHR, S_IFBLK):
        rules.add_rule(refuse, "mknod", pyseccomp.Arg(1, pyseccomp.MASKED_EQ, S_IFMT, kind))
        rules.add_rule(refuse, "mknodat", pyseccomp.Arg(2, pyseccomp.MASKED_EQ, S_IFMT, kind))
    rules.load()


def _lower_port_floor(port: int) -> None:
    Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").write_text(str(port))


def run(spec: Spec) -> None:
    """Confine this process as the docstring says, then exec diod (never returns)."""
    _enter_cgroup(spec.cgroup)
    _lower_port_floor(int(spec.listen.rpartition(":")[2]))
    helper, ready = _map_helper(spec)
    _check(_libc.unshare(CLONE_NEWNS), "unshare the mount namespace")
    _build_root(spec)
    _enter_user_namespace(helper, ready)
    _libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    _seccomp()
    argv = [SERVER, "-f", "-n", "-N", "-L", "stderr", "-l", spec.listen]
    for export in spec.exports:
        argv += ["-e", export]
    os.execve(SERVER, argv, {"LD_LIBRARY_PATH": LIBRARIES})


if __name__ == "__main__":
    run(Spec(**json.loads(sys.argv[1])))
