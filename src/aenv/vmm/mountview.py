"""The VMMs' view of the filesystem: the host's read-only, only the node's VM directories writable.

A QEMU that a guest took over must not be able to change the host (`/etc`, `/usr`, other
services' data, the node's database) nor read the node's secrets, even though it runs as uid
0. The node starts this module once (`python -m aenv.vmm.mountview DIR... --hide DIR...`): it
makes a private mount namespace in which every mount is read-only (recursively, with
`mount_setattr`) except bind mounts of the writable directories, with an empty read-only tmpfs
over each hidden one, says `ready` and stays until its standard input closes (the node stopped
or died). QEMU processes join that namespace with `nsenter --mount=/proc/<pid>/ns/mnt`, which execs
in place, and keep it alive after the helper is gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWNS = 0x00020000
MS_RDONLY = 1
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MOUNT_ATTR_RDONLY = 0x1
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
SYS_MOUNT_SETATTR = 442  # the same on every architecture (syscalls numbered since 5.1 are shared)
READY = "ready"
HIDE = "--hide"

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


def _set_read_only(path: str, read_only: bool) -> None:
    attr = MountAttr(MOUNT_ATTR_RDONLY if read_only else 0, 0 if read_only else MOUNT_ATTR_RDONLY, 0, 0)
    flags = AT_RECURSIVE
    result = _libc.syscall(
        SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), flags, ctypes.byref(attr), ctypes.sizeof(attr)
    )
    _check(result, f"mount_setattr {path}")


def isolate(writable: list[Path], hidden: list[Path]) -> None:
    """Move this process into a new mount namespace where only `writable` can be written and
    `hidden` directories look empty."""
    _check(_libc.unshare(CLONE_NEWNS), "unshare")
    _mount(None, "/", MS_REC | MS_PRIVATE)  # nothing done here reaches the host's namespace
    for path in writable:
        _mount(str(path), str(path), MS_BIND | MS_REC)
    _set_read_only("/", True)
    for path in writable:
        _set_read_only(str(path), False)
    for path in hidden:
        _mount("tmpfs", str(path), MS_RDONLY, "tmpfs", "mode=0,size=4k")


@dataclass
class MountView:
    """The running helper that holds the VMMs' mount namespace."""

    process: subprocess.Popen[str]

    @classmethod
    def start(cls, writable: list[Path], hidden: list[Path]) -> MountView:
        process = subprocess.Popen(
            [sys.executable, "-m", __name__, *map(str, writable), HIDE, *map(str, hidden)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert process.stdout is not None and process.stderr is not None
        if process.stdout.readline().strip() != READY:
            process.wait()
            raise OSError(f"the VMM mount namespace could not be made: {process.stderr.read().strip()}")
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
    split = args.index(HIDE) if HIDE in args else len(args)
    isolate([Path(arg) for arg in args[:split]], [Path(arg) for arg in args[split + 1 :]])
    print(READY, flush=True)
    sys.stdin.read()  # until the node closes it, or dies


if __name__ == "__main__":
    main()
