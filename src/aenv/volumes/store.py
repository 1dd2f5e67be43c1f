"""Volumes on disk: `<home>/volumes/<id>/volume.json` (name, token, size; root-only),
`volume.img` and `data/`.

A volume's id and token are generated here; its name is the user's, unique on the node, and is
what sandboxes mount it by (E2B's `volumeMounts` name volumes, not ids).

Each volume is a filesystem of its own: an ext4 image of the volume's size (sparse: it takes the
host's disk only as it fills), loop-mounted `nodev,nosuid,noexec` on `data/`. That bounds what
the content API and every guest together can write (ENOSPC past it, never a neighbour's or the
node's space lost) with nothing to account in the node, and no device node on it ever opens.
Measured here: creating one of 1 GiB (truncate, mkfs.ext4, mount) takes ~10 ms and 0.7 MiB of
host disk; deleting one is an unmount and an unlink, whatever its tree. The image is mounted
when the store opens (the node's start) or the volume is made, and unmounted by `close`.

Files belong to the guests' uids shifted into `IdRange` (the host uids the volume server maps
guests onto); the content API shows and takes guest uids. A volume made before volumes had
images (a plain `data/` directory, `size_mib` 0) is served as it is: without a size limit,
and its files' owners as the host's (outside the range they show as the overflow uid 65534).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import subprocess
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from ..agent.envd.state import same_secret
from ..clock import rfc3339
from ..orchestrator.errors import Conflict, Forbidden, InvalidRequest, NotFound, OperationFailed
from ..orchestrator.ids import new_sandbox_id
from .tree import remove_tree

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
NAME = re.compile(NAME_PATTERN)
VOLUME_ID = re.compile(r"^vol[a-z0-9]{20}$")
log = logging.getLogger(__name__)

RECORD = "volume.json"
IMAGE = "volume.img"
MIN_VOLUME_MIB = 16  # below this ext4's own metadata is most of the volume
# The image is a new sparse file, which reads as zeros: so neither mkfs nor the kernel's lazy
# init thread need to zero the journal and inode tables (measured at 1 GiB: 33 MiB of host disk
# and 14 ms with them zeroed, 0.7 MiB and 10 ms without).
MKFS_OPTIONS = "lazy_journal_init=1,lazy_itable_init=1"
MOUNT_OPTIONS = "loop,nodev,nosuid,noexec,noinit_itable"
GUEST_IDS = 65536  # guests' uids and gids 0..65535 are mapped (every user a Linux image has)
OVERFLOW_ID = 65534  # what an id outside the range shows as (the kernel's overflow uid)


@dataclass(frozen=True)
class IdRange:
    """The host uids (and gids) `base`..`base+count-1` that guests' ids 0..count-1 become."""

    base: int
    count: int

    def host(self, guest_id: int) -> int:
        if not 0 <= guest_id < self.count:
            raise InvalidRequest(
                f"uid/gid {guest_id} is out of range: volumes hold ids 0 to {self.count - 1}"
            )
        return self.base + guest_id

    def guest(self, host_id: int) -> int:
        return host_id - self.base if self.base <= host_id < self.base + self.count else OVERFLOW_ID


@dataclass(frozen=True)
class Volume:
    volume_id: str
    name: str
    token: str
    created_at: str
    size_mib: int = 0  # 0: a volume from before sizes (a plain directory, no limit)


class VolumeStore:
    """The node's volumes. `in_use(name)` names the sandboxes mounting one (deletes are refused)."""

    def __init__(
        self,
        root: Path,
        ids: IdRange,
        default_size_mib: int,
        in_use: Callable[[str], list[str]] = lambda name: [],
    ):
        self.root = root
        self.ids = ids
        self.default_size_mib = default_size_mib
        self.in_use = in_use
        self._lock = threading.Lock()  # create and delete check names against the whole set
        self._mounting = threading.Lock()
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for volume in self.all():
            try:
                self.data(volume)
            except OperationFailed as exc:  # that volume fails its uses (saying why), not the node
                log.error("volume %s (%s) cannot be mounted: %s", volume.volume_id, volume.name, exc.message)

    def data(self, volume: Volume) -> Path:
        """The directory holding the volume's files (what sandboxes and the content API see),
        its filesystem mounted."""
        return self._mount(self.root / volume.volume_id)

    def _mount(self, directory: Path) -> Path:
        data = directory / "data"
        with self._mounting:
            if (directory / IMAGE).exists() and not data.is_mount():
                _run("mount", "-o", MOUNT_OPTIONS, str(directory / IMAGE), str(data))
        return data

    def close(self) -> None:
        """Unmount every volume (their servers are gone: the node is stopping)."""
        for volume in self.all():
            data = self.root / volume.volume_id / "data"
            if data.is_mount():
                with contextlib.suppress(OperationFailed):
                    _run("umount", str(data))

    def all(self) -> list[Volume]:
        found = []
        for directory in sorted(self.root.iterdir()):
            if VOLUME_ID.match(directory.name):
                try:
                    found.append(Volume(**json.loads((directory / RECORD).read_text())))
                except (OSError, ValueError, TypeError):
                    continue  # a volume being created or deleted right now
        return sorted(found, key=lambda v: (v.created_at, v.volume_id))

    def create(self, name: str, size_mib: int | None = None) -> Volume:
        """A new volume of `size_mib` (the node's default if None)."""
        if not NAME.match(name):
            raise InvalidRequest(
                f"volume name {name!r} is not valid: 1 to 63 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        with self._lock:
            if self.by_name(name) is not None:
                raise Conflict(f"a volume named '{name}' already exists")
            size = size_mib or self.default_size_mib
            volume = Volume("vol" + new_sandbox_id()[1:], name, secrets.token_urlsafe(32), rfc3339(), size)
            directory = self.root / volume.volume_id
            try:
                self._make_filesystem(directory, size)
                fd = os.open(directory / RECORD, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    json.dump(asdict(volume), f)
            except BaseException:
                self._remove(directory)
                raise
        return volume

    def _make_filesystem(self, directory: Path, size_mib: int) -> None:
        """The volume's image, made and mounted on `data/`. Its root belongs to the guests' root
        and is writable by every user of every sandbox (as /tmp, without the sticky bit): which
        uid a guest's user has depends on its image. Entries below get their own modes."""
        (directory / "data").mkdir(parents=True)
        image = directory / IMAGE
        with open(image, "xb") as f:
            f.truncate(size_mib * 2**20)
        root_owner = f"{self.ids.base}:{self.ids.base}"
        _run("mkfs.ext4", "-q", "-F", "-m", "0", "-E", f"root_owner={root_owner},{MKFS_OPTIONS}", str(image))
        data = self._mount(directory)
        (data / "lost+found").rmdir()  # not the user's; e2fsck makes it again if it needs one
        data.chmod(0o777)

    def _remove(self, directory: Path) -> None:
        """Unmount and delete a volume's directory (its record already gone or never written)."""
        data = directory / "data"
        if data.is_mount():
            _run("umount", str(data))
        (directory / IMAGE).unlink(missing_ok=True)
        if data.exists():
            _remove_files(directory)
        shutil.rmtree(directory)

    def by_name(self, name: str) -> Volume | None:
        return next((v for v in self.all() if v.name == name), None)

    def get(self, volume_id: str) -> Volume:
        if VOLUME_ID.match(volume_id):
            try:
                return Volume(**json.loads((self.root / volume_id / RECORD).read_text()))
            except (OSError, ValueError, TypeError):
                pass
        raise NotFound(f"volume {volume_id} not found")

    def authorized(self, volume_id: str, authorization: str | None) -> Volume:
        """The volume if `authorization` is `Bearer <its token>` (the content API's credential)."""
        volume = self.get(volume_id)
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not same_secret(token.strip(), volume.token):
            raise Forbidden(f"invalid or missing token for volume {volume_id}")
        return volume

    def delete(self, volume_id: str) -> None:
        """Delete the volume and its files; 409 while a sandbox (running or paused) mounts it."""
        with self._lock:
            volume = self.get(volume_id)
            if users := self.in_use(volume.name):
                raise Conflict(
                    f"volume '{volume.name}' is mounted by sandbox(es) {', '.join(sorted(users))}: "
                    "kill them first"
                )
            directory = self.root / volume_id
            data = directory / "data"
            if data.is_mount():  # first, so that a volume busy on the host stays whole
                _run("umount", str(data))
            if not (directory / IMAGE).exists():  # a plain directory: its files, before the record
                try:
                    _remove_files(directory)
                except OSError as exc:
                    raise OperationFailed(
                        f"volume {volume_id} was not deleted: removing its files failed ({exc.strerror}); "
                        "the volume and its remaining files are still there"
                    ) from None
            (directory / IMAGE).unlink(missing_ok=True)
            (directory / RECORD).unlink()
            self._remove(directory)


def _remove_files(directory: Path) -> None:
    """Delete `directory/data` and everything below it, at any depth, following no symlink."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        remove_tree(fd, "data")
    finally:
        os.close(fd)


def _run(*argv: str) -> None:
    """Run a host tool (mount, umount, mkfs.ext4); its complaint becomes the operation's error."""
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip()[-300:]
        raise OperationFailed(f"{argv[0]} failed ({done.returncode}): {said}")
