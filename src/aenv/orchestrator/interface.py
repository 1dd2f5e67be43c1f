"""The node service: everything the HTTP API may ask of a node, cut into cohesive protocols.

The API layer talks to a node only through these, by sandbox id and with plain records in and
out, so the same handlers serve one node in process (`aenv.orchestrator.local.LocalNode`) or a
gateway that forwards each call to the node that holds the sandbox (`aenv.cluster.clusternode`).
Failures are the typed errors of `aenv.orchestrator.errors`; which HTTP route and status each
becomes is the API's (`aenv.api`).

`NodeService` is what a node and a gateway both serve, and what travels between them
(`aenv.cluster.wire` derives the calls from its type hints): sandboxes, their handover between
nodes, checkpoints, observation, the catalog, template builds and the node's status.
`RouteService` (where a running sandbox's traffic goes) is a node's alone: a sandbox's network
namespace exists only on its node, and a gateway's proxy forwards to the node instead.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, Protocol, runtime_checkable

from ..network.netns import SandboxNetwork
from ..repository.manifest import SnapshotManifest
from ..runtime.cache import CacheStats
from ..snapshot.checkpoints import Checkpoint
from ..template.builds import TagInfo
from ..template.steps import BuildRequest, BuildStart
from .housekeeping import GcTotals
from .store import SandboxRecord


@dataclass(frozen=True)
class CreateRequest:
    template: str
    timeout: int | None = None  # seconds; None: the node's default
    auto_pause: bool = False
    auto_pause_memory: bool = True  # false: a timeout's pause keeps only the disk
    auto_resume: bool = False
    secure: bool = True
    allow_internet: bool | None = None
    network: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    volume_mounts: list[dict[str, str]] = field(default_factory=list)  # [{"name", "path"}]
    # The new sandbox's id when the caller chose it (a gateway names a sandbox before placing it,
    # so the placement records its binding); None: the node makes one.
    sandbox_id: str | None = None


@dataclass(frozen=True)
class FanOutRequest:
    """`count` sandboxes from one create's options (`aenv.orchestrator.fanout`). With an
    `idempotency_key` their ids follow from the key, so a retried call finds them instead of
    making new ones."""

    create: CreateRequest
    count: int
    idempotency_key: str | None = None


@dataclass(frozen=True)
class FanOutFailure:
    """Why one sandbox of a fan-out did not start: the `SandboxError` kind's name and its message."""

    kind: str
    message: str
    error_code: str | None = None


@dataclass(frozen=True)
class FanOutResult:
    """One sandbox of a fan-out: its record, or why it did not start."""

    sandbox: SandboxRecord | None = None
    error: FanOutFailure | None = None


@dataclass(frozen=True)
class ListQuery:
    """E2B's list filters; an empty field filters nothing."""

    states: frozenset[str] = frozenset()  # "running", "paused"
    metadata: dict[str, str] = field(default_factory=dict)
    template: str | None = None  # a template's id or alias
    started_after: datetime | None = None  # inclusive bounds on the start time
    started_before: datetime | None = None
    order: Literal["asc", "desc"] = "desc"  # by start time
    # Paging, from a caller that pages (the API): only the matches after `after` (a start time and
    # an id, in the list's order), at most `limit` of them. Through a gateway each node then sends
    # a page, not all it holds. A node may ignore these: the caller applies them again.
    after: tuple[str, str] | None = None
    limit: int | None = None

    def page(self, ordered: list[SandboxRecord]) -> list[SandboxRecord]:
        """Of matches in the list's order, those after `after`, at most `limit`."""
        if self.after is not None:
            after, ascending = self.after, self.order == "asc"
            ordered = [r for r in ordered if follows((r.started_at, r.sandbox_id), after, ascending)]
        return ordered if self.limit is None else ordered[: self.limit]


def follows(position: tuple[str, str], cursor: tuple[str, ...], ascending: bool) -> bool:
    """Whether an item comes after the cursor: time in the list's order, then id ascending."""
    later = position[0] > cursor[0] if ascending else position[0] < cursor[0]
    return later or (position[0] == cursor[0] and position[1] > cursor[1])


@dataclass(frozen=True)
class Route:
    """Where data-plane traffic for a running sandbox goes, with what it takes to be let in."""

    record: SandboxRecord
    network: SandboxNetwork


@dataclass(frozen=True)
class BuildTicket:
    """A registered template build, waiting for its steps."""

    template_id: str
    build_id: str
    tags: list[str]


@dataclass(frozen=True)
class FileLink:
    """Whether a COPY's files are here; if not, the expiry and signature of their upload URL."""

    present: bool
    expires: int = 0
    signature: str = ""


@dataclass(frozen=True)
class NodeStatus:
    node_id: str
    records: list[SandboxRecord]
    create_successes: int
    create_failures: int
    lost: int  # sandboxes whose VM process exited without the node asking it to
    parked: int  # paused sandboxes that keep their stopped QEMU process
    gc: GcTotals
    cache: CacheStats | None = None  # the runtime cache of a remote repository (None: posix)
    merged_bytes: int = 0  # host RAM memory merging saves in the sandboxes' QEMUs (aenv.vmm.merge)


class SandboxService(Protocol):
    """A sandbox's life: create, find, pause and resume, end, and what it may reach."""

    async def create(self, request: CreateRequest) -> SandboxRecord: ...

    async def get(self, sandbox_id: str) -> SandboxRecord: ...

    async def list(self, query: ListQuery) -> list[SandboxRecord]: ...

    async def kill(self, sandbox_id: str) -> None: ...

    async def pause(self, sandbox_id: str, *, memory: bool = True) -> SandboxRecord:
        """Pause the sandbox; without `memory` only its disk is kept (its resume boots afresh).
        Returns the paused sandbox."""
        ...

    async def connect(
        self, sandbox_id: str, timeout: int | None, *, memory: bool = True
    ) -> tuple[SandboxRecord, bool]:
        """Resume a paused sandbox or extend a running one's TTL; also says whether it resumed.
        Without `memory` a paused sandbox boots from its disk, whatever its pause kept."""
        ...

    async def resume(self, sandbox_id: str, timeout: int | None, *, memory: bool = True) -> SandboxRecord: ...

    async def set_timeout(self, sandbox_id: str, timeout: int) -> None: ...

    async def refresh(self, sandbox_id: str, duration: int | None) -> None: ...

    async def snapshot(self, sandbox_id: str, name: str | None, *, memory: bool = True) -> SnapshotManifest:
        """Snapshot a running sandbox; without `memory` only its disk (sandboxes from it boot)."""
        ...

    async def fork(self, sandbox_id: str, count: int, timeout: int | None) -> list[SandboxRecord]: ...

    async def fan_out(self, request: FanOutRequest) -> list[FanOutResult]:
        """Start `request.count` sandboxes with the same options; one result per sandbox, in order."""
        ...

    async def update_network(
        self, sandbox_id: str, allow_internet: bool | None, network: dict[str, Any]
    ) -> None: ...


class HandoverService(Protocol):
    """A durable pause (committed to a repository nodes share) continued or ended by another node."""

    async def take_over(self, sandbox_id: str, timeout: int | None) -> SandboxRecord:
        """Resume here a sandbox durably paused on another node sharing this node's repository.

        The pause must be durable (the record's `durable`, as the pausing node reports it):
        otherwise NotFound, also when the pausing node has claimed the pause back (resumed or
        ended the sandbox), both with the error code `PAUSE_GONE`. Conflict if another node took
        it over first (one claim in the repository decides), or if the sandbox is on this node
        already (resume it instead). The node it was paused on forgets it (its lookups answer
        NotFound saying where it went).
        """
        ...

    async def discard_pause(self, sandbox_id: str) -> None:
        """Delete from the shared repository the durable pause of a sandbox paused on another node.

        For a sandbox killed while its node is down (a gateway's kill, `Scheduler.tombstone`):
        that node may never come back to delete it, and a committed pause keeps its blobs for
        ever. The pause is claimed first, as a take-over claims it, so whoever continues or ends
        the sandbox meanwhile wins or loses by that one claim: Conflict if another node claimed
        it (a take-over, or its own node back), NotFound if there is no such pause, Conflict with
        the error code `NOT_SHARED` on a node whose repository is its own, and Conflict if the
        sandbox is on this node (kill it).
        """
        ...


class CheckpointService(Protocol):
    """Checkpoints of a running sandbox, kept while it lives: the RL workload's reset points."""

    async def checkpoint(self, sandbox_id: str, name: str | None) -> Checkpoint:
        """Checkpoint the running sandbox (memory and disk), kept while it lives."""
        ...

    async def checkpoints(self, sandbox_id: str) -> list[Checkpoint]:
        """The sandbox's checkpoints, oldest first."""
        ...

    async def delete_checkpoint(self, sandbox_id: str, checkpoint: str) -> None: ...

    async def promote_checkpoint(
        self, sandbox_id: str, checkpoint: str, name: str | None
    ) -> SnapshotManifest:
        """A checkpoint of the running sandbox as a snapshot, which sandboxes can start from."""
        ...

    async def reset(self, sandbox_id: str, checkpoint: str) -> SandboxRecord:
        """Restore the running sandbox to its checkpoint (id or name): same id, URL and tokens."""
        ...


class ObservationService(Protocol):
    """What a sandbox's user can read of it from outside: its metrics and its console."""

    async def metrics(self, sandbox_id: str, start: int | None, end: int | None) -> list[dict[str, Any]]:
        """E2B `SandboxMetric`s of the sandbox between `start` and `end` (Unix seconds), oldest first."""
        ...

    async def latest_metrics(self, sandbox_ids: list[str]) -> dict[str, dict[str, Any]]:
        """The newest `SandboxMetric` of each known sandbox among `sandbox_ids`; unknown ones are left out."""
        ...

    async def logs(self, sandbox_id: str, start: int, limit: int) -> tuple[int, list[str]]:
        """`limit` lines of the serial console from line `start` (counted from the sandbox's
        first), and the number of the first (the oldest kept, for a `start` before it)."""
        ...


class CatalogService(Protocol):
    """The templates and snapshots sandboxes start from."""

    async def catalog(self, kind: str | None = None) -> list[SnapshotManifest]:
        """Templates and snapshots users can see (a fork's internal snapshot is not one)."""
        ...

    async def find(self, reference: str, kind: str | None = None) -> SnapshotManifest: ...

    async def delete_template(self, reference: str) -> None: ...


class BuildService(Protocol):
    """E2B's template build API: a build's registration, files, steps, progress, and its tags."""

    async def request_template_build(self, request: BuildRequest) -> BuildTicket: ...

    async def template_file(self, template_id: str, files_hash: str) -> FileLink: ...

    async def receive_template_file(
        self,
        template_id: str,
        files_hash: str,
        expires: str,
        signature: str,
        chunks: AsyncIterator[bytes],
        size: int | None,
    ) -> None:
        """Store a COPY's files sent to a presigned URL (checked here: signature, expiry, size)."""
        ...

    async def start_template_build(self, template_id: str, build_id: str, start: BuildStart) -> None: ...

    async def template_build_status(
        self, template_id: str, build_id: str, offset: int, limit: int
    ) -> dict[str, Any]:
        """E2B's `TemplateBuildInfo`: status, log entries from `offset`, and a failure's reason."""
        ...

    async def assign_template_tags(self, target: str, tags: list[str]) -> tuple[str, list[str]]: ...

    async def remove_template_tags(self, name: str, tags: list[str]) -> None: ...

    async def template_tags(self, reference: str) -> list[TagInfo]: ...


class StatusService(Protocol):
    """What operators read of the node as a whole (its `/metrics`)."""

    async def status(self) -> NodeStatus: ...


class NodeService(
    SandboxService,
    HandoverService,
    CheckpointService,
    ObservationService,
    CatalogService,
    BuildService,
    StatusService,
    Protocol,
):
    """Everything a node and a gateway serve alike."""


@runtime_checkable
class RouteService(Protocol):
    """Where a running sandbox's data-plane traffic goes: a node's alone (see the module docstring)."""

    async def route(self, sandbox_id: str, *, resume: bool) -> Route | None:
        """The running sandbox's route; a paused one with auto-resume on is resumed if `resume`."""
        ...
