"""Records the cluster's parts exchange: what a node is, holds and has room for, and where a
sandbox lives. Pydantic models, so the same classes validate the scheduler's HTTP bodies and
the JSON kept in Redis."""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from ..orchestrator.states import api_state

if TYPE_CHECKING:
    from ..orchestrator.store import SandboxRecord

# Node and sandbox ids: what the node and the orchestrator make (hex, [a-z0-9]), and safe in
# Redis keys, URL paths and the scheduler's messages.
ID_PATTERN = r"^[A-Za-z0-9._-]{1,128}$"


class NodeState(StrEnum):
    UP = "up"  # heartbeating, takes placements
    DRAINING = "draining"  # heartbeating, keeps its sandboxes, takes no new placements
    DOWN = "down"  # silent longer than the scheduler's node_down_after: its running sandboxes are lost


class NodeCapacity(BaseModel):
    memory_mib: int = Field(ge=0)  # guest RAM the node admits in total (RAM x overcommit)
    vcpus: int = Field(ge=0)
    disk_free_mib: int = Field(ge=0)  # what the node may still write above its disk reserve


class NodeUsage(BaseModel):
    running: int = Field(default=0, ge=0)
    paused: int = Field(default=0, ge=0)
    memory_mib: int = Field(default=0, ge=0)  # guest RAM of running sandboxes
    vcpus: int = Field(default=0, ge=0)


class NodeInfo(BaseModel):
    node_id: str = Field(pattern=ID_PATTERN)
    address: str = Field(min_length=1)  # base URL of the node's API and proxy, e.g. http://10.0.0.5:8000
    version: str
    status: NodeState = NodeState.UP
    capacity: NodeCapacity
    usage: NodeUsage = Field(default_factory=NodeUsage)
    cached: list[str] = Field(default_factory=list)  # snapshot/template ids materialized on the node
    registered_at: float = 0.0  # Unix seconds, set by the scheduler
    heartbeat_at: float = 0.0


class Binding(BaseModel):
    """Which node holds a sandbox. `durable`: its paused state is committed to the shared
    repository, so any node can resume it when its own node is gone. `generation`: the node's
    count of the sandbox's settled changes (`SandboxRecord.generation`) when this was read, so
    that a report that took longer to arrive than a later one does not undo it (0: unknown)."""

    sandbox_id: str = Field(pattern=ID_PATTERN)
    node_id: str = Field(pattern=ID_PATTERN)
    state: Literal["running", "paused"] = "running"
    template_id: str = ""
    durable: bool = False
    generation: int = Field(default=0, ge=0)

    @classmethod
    def of(cls, record: SandboxRecord, node_id: str) -> Binding:
        """The binding of `node_id`'s sandbox as its record stands (in E2B's two states)."""
        return cls(
            sandbox_id=record.sandbox_id, node_id=node_id, state=api_state(record.state),  # type: ignore[arg-type]
            template_id=record.template_id, durable=record.durable, generation=record.generation,
        )  # fmt: skip


class Placement(BaseModel):
    """A request for a node: to create (from `template`) or to resume `sandbox_id`."""

    kind: Literal["create", "resume"] = "create"
    template: str = ""  # template/snapshot id: nodes that cache it are preferred
    sandbox_id: str | None = None  # for a resume: its current node is preferred while up
    memory_mib: int = Field(default=512, ge=1)
    vcpus: int = Field(default=1, ge=1)
    exclude: list[str] = Field(default_factory=list)  # node ids not to use (a retry after a failure)


class Heartbeat(BaseModel):
    """What a node reports on each heartbeat (the body of the scheduler's heartbeat route)."""

    usage: NodeUsage
    capacity: NodeCapacity
    cached: list[str] = Field(default_factory=list)


class Location(BaseModel):
    """Where a sandbox is: its binding and its node (the answer to a locate)."""

    binding: Binding
    node: NodeInfo
