"""Volume mounts: the node's 9P server for this sandbox, mounted where the create asked.

The node starts a server in the sandbox's namespace (at the gateway address) and then sends
`volumeMounts` in a `/init` of its own, after every create, resume and fork. A restored guest
still holds the mounts of the guest it was saved from, whose TCP connections went with that
guest's server: they are detached first (files left open on them fail with EIO), then every
wanted volume is mounted again, so the same paths work after a resume or in a fork child.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from dataclasses import dataclass
from typing import Any

from .inputs import invalid, path_string, text

log = logging.getLogger(__name__)

MNT_DETACH = 2
MAX_MOUNTS = 64
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class VolumeMount:
    path: str  # where in the guest
    export: str  # the server's attach name for the volume
    port: int


def parse(value: Any) -> list[VolumeMount]:
    """The `/init` body's `volumeMounts`: [{"path", "export", "port"}]; ConnectError if malformed."""
    if not isinstance(value, list) or len(value) > MAX_MOUNTS:
        raise invalid(f"volumeMounts must be a list of at most {MAX_MOUNTS} mounts")
    mounts = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("port"), int):
            raise invalid("each volume mount needs a path, an export and a port")
        path = os.path.normpath(path_string(text(item, "path"), "volume mount path"))
        if not path.startswith("/") or path == "/":
            raise invalid(f"volume mount path {path!r} must be absolute and not /")
        mounts.append(VolumeMount(path, path_string(text(item, "export"), "volume export"), item["port"]))
    return mounts


def served_by(server: str, mountinfo: str) -> list[str]:
    """Mount points of 9P filesystems from `server` in a mountinfo table, deepest first."""
    found = []
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        kind, source = [*tail.split(), "", ""][:2]
        if kind == "9p" and source == server:
            found.append(fields.split()[4].encode().decode("unicode_escape"))
    return sorted(found, key=len, reverse=True)


def _mount(server: str, mount: VolumeMount) -> None:
    # access=user: each guest uid attaches as itself (numerically), so files keep their owners;
    # the mount's own attach names root, the one name the server knows without a user database.
    options = f"trans=tcp,port={mount.port},version=9p2000.L,aname={mount.export},access=user,uname=root"
    os.makedirs(mount.path, exist_ok=True)
    if _libc.mount(server.encode(), mount.path.encode(), b"9p", 0, options.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mounting volume {mount.export} on {mount.path}: {os.strerror(err)}")


def apply(server: str, mounts: list[VolumeMount]) -> None:
    """Detach every mount of `server` this guest holds, then mount `mounts` from it."""
    with open("/proc/self/mountinfo") as f:
        stale = served_by(server, f.read())
    for target in stale:
        if _libc.umount2(target.encode(), MNT_DETACH) != 0 and ctypes.get_errno() != errno.EINVAL:
            log.warning(
                "cannot detach the stale volume mount %s: %s", target, os.strerror(ctypes.get_errno())
            )
    for mount in sorted(mounts, key=lambda m: m.path.count("/")):  # a mount inside another one comes after it
        _mount(server, mount)
        log.info("volume %s mounted on %s", mount.export, mount.path)
