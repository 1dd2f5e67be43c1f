"""The launch plan: what a sandbox starts with, built in one place for create, take-over and fork.

Each start of a sandbox on this node (a create from a template, a take-over of a pause made on
another node, a child of a fork) needs the same three things: the record the node keeps and
reports, the egress policy its network gets and what its guest is told (`GuestInit`). Building
them here, from one set of rules (fresh tokens for a secure sandbox, the end time from the
timeout, the record in `creating` until the start succeeds), keeps the three paths from
drifting apart.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from .. import clock
from ..agent.envd import ENVD_VERSION
from ..clock import rfc3339
from ..network.egress import EgressPolicy
from ..repository.manifest import SnapshotManifest
from ..snapshot.model import GuestInit
from .errors import InvalidRequest
from .ids import new_sandbox_id
from .interface import CreateRequest
from .states import State
from .store import SandboxRecord

DISK_SIZE_MB = 4096  # what a sandbox's disk is reported as (its layers grow up to the image's size)


def egress_policy(allow_internet: bool | None, network: dict[str, Any]) -> EgressPolicy:
    """The E2B network fields as a policy; 400 for what it cannot express (domain names)."""
    try:
        return EgressPolicy(
            allow_internet=allow_internet is not False,
            allow_out=tuple(network.get("allowOut") or ()),
            deny_out=tuple(network.get("denyOut") or ()),
        )
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


def guest_init(record: SandboxRecord) -> GuestInit:
    """What the sandbox's guest is told at each start: its environment and its access token."""
    return GuestInit(env_vars=record.env_vars, access_token=record.envd_token)


def _token(wanted: bool) -> str | None:
    return secrets.token_hex(32) if wanted else None


@dataclass(frozen=True)
class LaunchPlan:
    """A sandbox about to start: its record (in `creating`), its network policy, its guest's init."""

    record: SandboxRecord
    timeout: int

    @property
    def policy(self) -> EgressPolicy:
        return egress_policy(self.record.allow_internet, self.record.network)

    @property
    def init(self) -> GuestInit:
        return guest_init(self.record)

    @classmethod
    def create(
        cls, request: CreateRequest, sandbox_id: str, manifest: SnapshotManifest, timeout: int
    ) -> LaunchPlan:
        """A new sandbox from a template or snapshot (its machine gives the sandbox's size)."""
        record = SandboxRecord(
            sandbox_id=sandbox_id, template_id=manifest.id, alias=manifest.alias, state=State.CREATING,
            created_at="", started_at="", end_at="", timeout=timeout, auto_pause=request.auto_pause,
            auto_pause_memory=request.auto_pause_memory, auto_resume=request.auto_resume,
            cpu_count=manifest.machine.vcpus, memory_mb=manifest.machine.memory_mib,
            disk_size_mb=DISK_SIZE_MB, envd_version=ENVD_VERSION, secure=request.secure,
            envd_token=_token(request.secure),
            traffic_token=_token(request.network.get("allowPublicTraffic") is False),
            allow_internet=request.allow_internet, network=request.network, metadata=request.metadata,
            env_vars=request.env_vars, volume_mounts=request.volume_mounts,
        )  # fmt: skip
        return cls._starting(record, timeout, born=True)

    @classmethod
    def fork_child(cls, source: SandboxRecord, timeout: int) -> LaunchPlan:
        """A child of a fork: the source's settings, a new id and new tokens, its own copies."""
        record = replace(
            source, sandbox_id=new_sandbox_id(), generation=0, paused_at=None,
            envd_token=_token(source.secure), traffic_token=_token(source.traffic_token is not None),
            metadata=dict(source.metadata), env_vars=dict(source.env_vars), network=dict(source.network),
            volume_mounts=[dict(m) for m in source.volume_mounts],
        )  # fmt: skip
        return cls._starting(record, timeout, born=True)

    @classmethod
    def take_over(cls, paused: SandboxRecord, timeout: int) -> LaunchPlan:
        """A sandbox paused on another node, continued here: its record as it was paused there."""
        return cls._starting(replace(paused, durable=False), timeout, born=False)

    @classmethod
    def _starting(cls, record: SandboxRecord, timeout: int, *, born: bool) -> LaunchPlan:
        """The record in `creating`; a new sandbox (`born`) is created and started now. Its end
        time is set again once it runs (`timeout` from then)."""
        record.state = State.CREATING
        if born:
            now = clock.now()
            record.created_at = record.started_at = rfc3339(now)
            record.end_at = rfc3339(now + timedelta(seconds=timeout))
            record.timeout = timeout
        return cls(record, timeout)


def check_timeout(timeout: int, max_timeout: int) -> None:
    if timeout > max_timeout:
        raise InvalidRequest(f"timeout must be at most {max_timeout} seconds")
