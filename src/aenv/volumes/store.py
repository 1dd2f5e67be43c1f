"""Volumes on disk: `<home>/volumes/<id>/volume.json` (name, token; root-only) and `data/`.

A volume's id and token are generated here; its name is the user's, unique on the node, and is
what sandboxes mount it by (E2B's `volumeMounts` name volumes, not ids).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from ..agent.envd.state import same_secret
from ..clock import rfc3339
from ..orchestrator.errors import Conflict, Forbidden, InvalidRequest, NotFound
from ..orchestrator.service import new_sandbox_id

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
NAME = re.compile(NAME_PATTERN)
VOLUME_ID = re.compile(r"^vol[a-z0-9]{20}$")
RECORD = "volume.json"


@dataclass(frozen=True)
class Volume:
    volume_id: str
    name: str
    token: str
    created_at: str


class VolumeStore:
    """The node's volumes. `in_use(name)` names the sandboxes mounting one (deletes are refused)."""

    def __init__(self, root: Path, in_use: Callable[[str], list[str]] = lambda name: []):
        self.root = root
        self.in_use = in_use
        self._lock = threading.Lock()  # create and delete check names against the whole set
        root.mkdir(mode=0o700, parents=True, exist_ok=True)

    def data(self, volume: Volume) -> Path:
        """The directory holding the volume's files (what sandboxes and the content API see)."""
        return self.root / volume.volume_id / "data"

    def all(self) -> list[Volume]:
        found = []
        for directory in sorted(self.root.iterdir()):
            if VOLUME_ID.match(directory.name):
                try:
                    found.append(Volume(**json.loads((directory / RECORD).read_text())))
                except (OSError, ValueError, TypeError):
                    continue  # a volume being created or deleted right now
        return sorted(found, key=lambda v: (v.created_at, v.volume_id))

    def create(self, name: str) -> Volume:
        if not NAME.match(name):
            raise InvalidRequest(
                f"volume name {name!r} is not valid: 1 to 63 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        with self._lock:
            if self.by_name(name) is not None:
                raise Conflict(f"a volume named '{name}' already exists")
            volume = Volume("vol" + new_sandbox_id()[1:], name, secrets.token_urlsafe(32), rfc3339())
            directory = self.root / volume.volume_id
            (directory / "data").mkdir(parents=True)
            # Writable by every user of every sandbox (as /tmp, without the sticky bit): which
            # uid a guest's user has depends on its image. Entries below get their own modes.
            (directory / "data").chmod(0o777)
            fd = os.open(directory / RECORD, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(volume), f)
        return volume

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
            (directory / RECORD).unlink()
            shutil.rmtree(directory, ignore_errors=True)
