"""What the parts of the snapshot engine share: a sandbox's saved state, its running VM, errors.

`SandboxState` is the file a sandbox leaves in its directory (`sandboxes/<id>/state.json`):
everything needed to resume it, kill it, or adopt its QEMU after the node process restarts.
Its shape is part of a node home's layout and must stay readable across versions.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..network.egress import EgressPolicy
from ..repository.contract import GcReport
from ..repository.manifest import SnapshotManifest
from ..vmm.envd_link import EnvdLink, utc_timestamp
from ..vmm.launcher import GuestVM
from ..vmm.machine import VirtualMachine

STATE_FILE = "state.json"
# Metadata of a filesystem-only snapshot (no memory): sandboxes started from it boot from its disk.
DISK_ONLY = "aenv.disk-only"


@dataclass(frozen=True)
class GuestInit:
    """What envd is told after every start or resume (E2B's `POST /init`)."""

    env_vars: dict[str, str] = field(default_factory=dict)
    access_token: str | None = None
    default_user: str | None = None
    default_workdir: str | None = None

    def payload(self, *, reseed: bool = True) -> dict[str, Any]:
        """The `/init` body; with `reseed`, fresh entropy for the guest's RNG.

        Restored guests share their snapshot's RNG state, so each new one is reseeded. A guest
        that was reseeded when restored (a warm VM) or that continues alone from its own state
        (a parked process resumed) is not: under TCG the reseed costs it ~1.3 ms on the path of
        the node's answer.
        """
        # The token always: a guest restored from a secured sandbox or a warm VM holds one, which
        # an unsecured sandbox's guest must drop ("").
        body: dict[str, Any] = {
            "envVars": self.env_vars,
            "timestamp": utc_timestamp(),
            "accessToken": self.access_token or "",
        }
        if reseed:
            body["entropy"] = base64.b64encode(os.urandom(64)).decode()
        if self.default_user:
            body["defaultUser"] = self.default_user
        if self.default_workdir:
            body["defaultWorkdir"] = self.default_workdir
        return body


def clock_payload() -> dict[str, Any]:
    """An `/init` body that sets the guest's clock (if it is off) and nothing else."""
    return {"timestamp": utc_timestamp()}


def replace_text(path: Path, text: str) -> None:
    """Replace `path` with `text`, whole or not at all for a reader or a crash of this process (not
    fsynced: node-local state that a host crash takes along with the VMs it describes). Mode 0600:
    the node's alone."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as file:
        file.write(text)
    os.replace(tmp, path)


@dataclass
class SandboxState:
    """What survives the QEMU process of a sandbox: enough to resume it, also after a node restart."""

    sandbox_id: str
    snapshot_id: str
    disk_layers: list[str]  # bottom to top; the top one is the sandbox's writable layer
    network_name: str
    delta: str | None = None  # path of the delta layer from the last pause
    devices: str | None = None  # path of the device state from the last pause
    paused: bool = False
    pid: int | None = None  # QEMU's, while running: a restarted node adopts it from here
    policy: dict[str, Any] = field(default_factory=dict)  # the egress policy, as EgressPolicy fields
    # The last pause kept only the disk (no delta, no device state): the resume boots afresh.
    disk_only: bool = False
    # The pause snapshot this pause was committed to the repository as (`aenv.snapshot.handover`).
    durable: str | None = None
    # The checkpoint its state descends from (its last checkpoint or reset: `aenv.snapshot.checkpoints`).
    checkpoint: str | None = None
    kept_layers: list[str] = field(default_factory=list)  # disk layers its checkpoints hold

    @property
    def egress(self) -> EgressPolicy:
        return EgressPolicy(**self.policy)

    def save(self, workdir: Path) -> None:
        replace_text(workdir / STATE_FILE, json.dumps(asdict(self)))

    @classmethod
    def load(cls, workdir: Path) -> SandboxState:
        return cls(**json.loads((workdir / STATE_FILE).read_text()))


@dataclass
class SandboxVM:
    """A running sandbox VM and where it came from."""

    state: SandboxState
    guest: GuestVM
    manifest: SnapshotManifest
    root_node: str = "root"  # QEMU's node name for the top of the root disk chain

    @property
    def sandbox_id(self) -> str:
        return self.state.sandbox_id

    @property
    def envd(self) -> EnvdLink:
        return self.guest.envd

    @property
    def vm(self) -> VirtualMachine:
        return self.guest.vm


@dataclass(frozen=True)
class GarbageReport:
    """What one `collect_garbage` pass removed: unused disk layers, then repository blobs."""

    removed_layers: tuple[str, ...]
    blobs: GcReport


class EngineError(RuntimeError):
    """A snapshot operation failed; the message says which and why."""
