"""The VMMs' view of the filesystem: a root of its own holding only what QEMU needs.

A QEMU that a guest took over must not be able to change the host nor read the node's state
and secrets. The node starts this module once (`python -m aenv.vmm.mountview RW... --read-only
RO...`): in a private mount namespace it builds a new root on a small tmpfs holding the system
directories (`/usr`, `/lib*`, `/etc`, `/sys`, read-only), a fresh `/proc`, a `/dev` with only
`null`, `zero`, `full`, `random`, `urandom` and `kvm`, the given read-only directories (the
guest artifacts) and the writable ones (the home's VM directories), each at its host path;
the rest of the host, the home's database and secrets included, is not there at all. It
pivots into that root, says `ready <tmpdir>` (the empty host directory the node removes) and
stays until its standard input closes (the node stopped or died). QEMU processes join the
namespace with `nsenter --mount=/proc/<pid>/ns/mnt`, which execs in place and lands in that
root, and keep it alive after the helper is gone.

The parents of the grafted directories are the tmpfs's own (mode 0755), so an unprivileged
VMM user reaches them even when the host's parents (`/root`, a 0700 temporary directory) are
closed to it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWNS = 0x00020000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
MOUNT_ATTR_RDONLY = 0x1
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
SYS_MOUNT_SETATTR = 442  # the same on every architecture (syscalls numbered since 5.1 are shared)
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
READY = "ready"
READ_ONLY = "--read-only"
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/sys")
DEVICES = ("null", "zero", "full", "random", "urandom", "kvm")

_libc = ctypes.CDLL(None, use_errno=True)


class MountAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("attr_set", "attr_clr", "propagation", "userns_fd")]


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, flags: int, fstype: str | None = None, data: str = "") -> None:
    encoded = [value.encode() if value else None for value in (source, fstype, data)]
    _check(_libc.mount(encoded[0], target.encode(), encoded[1], flags, encoded[2]), f"mount {target}")


def _set_read_only(path: str, *, recursive: bool = True) -> None:
    attr = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    flags = AT_RECURSIVE if recursive else 0
    result = _libc.syscall(
        SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), flags, ctypes.byref(attr), ctypes.sizeof(attr)
    )
    _check(result, f"mount_setattr {path}")


def _graft(source: Path, root: Path, *, read_only: bool) -> None:
    """`source` at the same path under `root`: a symbolic link copied, anything else bind-mounted."""
    target = root / source.relative_to("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_symlink():
        target.symlink_to(os.readlink(source))
        return
    if source.is_dir():
        target.mkdir()
    else:
        target.touch()
    _mount(str(source), str(target), MS_BIND | MS_REC)
    if read_only:
        _set_read_only(str(target))


def _pivot(root: Path) -> None:
    """Make `root` this namespace's root and drop the old one (pivot_root(2)'s `.` `.` idiom)."""
    os.chdir(root)
    _check(_libc.syscall(SYS_PIVOT_ROOT[os.uname().machine], b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "umount the old root")
    os.chdir("/")


def isolate(writable: list[Path], readable: list[Path]) -> Path:
    """Move this process into a new mount namespace rooted in a tmpfs holding the system
    directories, `readable` (read-only) and `writable`; returns the host directory the root was
    built on (empty, for the caller to remove)."""
    _check(_libc.unshare(CLONE_NEWNS), "unshare")
    _mount(None, "/", MS_REC | MS_PRIVATE)  # nothing done here reaches the host's namespace
    build = Path(tempfile.mkdtemp(prefix="aenv-vmm-root-"))
    _mount("tmpfs", str(build), MS_NOSUID | MS_NODEV, "tmpfs", "mode=0755,size=1m")
    grafts = [(Path(p), True) for p in SYSTEM if os.path.lexists(p)]
    grafts += [(p, True) for p in readable] + [(p, False) for p in writable]
    done: list[Path] = []
    for source, read_only in sorted(grafts, key=lambda graft: len(graft[0].parts)):
        if not any(source.is_relative_to(parent) for parent in done):  # already inside a graft
            _graft(source, build, read_only=read_only)
            done.append(source)
    (build / "proc").mkdir()
    _mount("proc", str(build / "proc"), MS_NOSUID | MS_NODEV | MS_NOEXEC, "proc")
    (build / "dev").mkdir()
    for name in DEVICES:
        if (device := Path("/dev", name)).exists():
            _graft(device, build, read_only=False)
    _pivot(build)
    _set_read_only("/", recursive=False)  # the tmpfs itself; the grafts keep their own modes
    return build


@dataclass
class MountView:
    """The running helper that holds the VMMs' mount namespace."""

    process: subprocess.Popen[str]

    @classmethod
    def start(cls, writable: list[Path], readable: list[Path]) -> MountView:
        process = subprocess.Popen(
            [sys.executable, "-m", __name__, *map(str, writable), READ_ONLY, *map(str, readable)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert process.stdout is not None and process.stderr is not None
        word, _, build = process.stdout.readline().strip().partition(" ")
        if word != READY:
            process.wait()
            raise OSError(f"the VMM mount namespace could not be made: {process.stderr.read().strip()}")
        with contextlib.suppress(OSError):  # only a mount point inside the helper's namespace
            os.rmdir(build)
        return cls(process)

    @property
    def namespace(self) -> str:
        return f"/proc/{self.process.pid}/ns/mnt"

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait()


def main() -> None:
    # A Ctrl-C or SIGTERM meant for the node's process group is not for this helper: it ends when
    # the node does, however the node ends.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    args = sys.argv[1:]
    split = args.index(READ_ONLY) if READ_ONLY in args else len(args)
    build = isolate([Path(arg) for arg in args[:split]], [Path(arg) for arg in args[split + 1 :]])
    print(READY, build, flush=True)
    sys.stdin.read()  # until the node closes it, or dies


if __name__ == "__main__":
    main()
