"""The scheduler as the other parts see it. Nodes use it to join and report, gateways to place
and locate sandboxes. `aenv.cluster.scheduler` serves it over HTTP on top of Redis; its HTTP
client implements this same protocol, so gateways and nodes can be tested against a fake.

Failures are the typed errors of `aenv.orchestrator.errors`: NotFound for an unknown node or
sandbox, Unavailable when no node has room or the scheduler cannot be reached, InvalidRequest
for malformed input, SandboxKilled (a Conflict) for a bind of a sandbox killed while its node
was away.
"""

from __future__ import annotations

from typing import Protocol

from ..orchestrator.errors import Conflict
from .model import Binding, NodeCapacity, NodeInfo, NodeUsage, Placement

KILLED = "sandbox_killed"  # the error code of `SandboxKilled`, which tells it apart from other 409s


class SandboxKilled(Conflict):
    """The sandbox was killed while its node could not be reached (its tombstone): it is not
    bound again, and the node that holds it must kill it."""

    def __init__(self, message: str, error_code: str | None = KILLED):
        super().__init__(message, error_code)


class Scheduler(Protocol):
    async def register(self, node: NodeInfo) -> NodeInfo:
        """Join (or rejoin after a restart) with the node's address, version and capacity."""
        ...

    async def heartbeat(
        self, node_id: str, usage: NodeUsage, capacity: NodeCapacity, cached: list[str]
    ) -> NodeInfo:
        """Report liveness and load; the answer carries the status the cluster gives the node
        (e.g. draining). NotFound if the scheduler does not know the node: register again."""
        ...

    async def nodes(self) -> list[NodeInfo]: ...

    async def node(self, node_id: str) -> NodeInfo: ...

    async def drain(self, node_id: str) -> NodeInfo:
        """No new placements on the node; its sandboxes stay where they are."""
        ...

    async def place(self, request: Placement) -> NodeInfo:
        """Choose a node and reserve the request's memory and vCPUs on it atomically (two
        schedulers never both spend the same room). Unavailable if no node has room. A create
        that names its sandbox (`sandbox_id`) is bound to the chosen node in the same step
        (Conflict if that id is bound already): its node is told the id, and no `bind` follows;
        if the create fails, `unbind` frees the room too."""
        ...

    async def bind(self, binding: Binding, *, observed: bool = False) -> None:
        """Record (or update) which node holds a sandbox and in what state. SandboxKilled if the
        sandbox was killed while its node was away (`tombstone`): it is never bound again.

        `observed`: not the node's report but what a gateway saw an operation on the node do.
        The node reports the same change itself, and may have reported a later one (its pause
        made durable) before this arrives, so an observed bind changes only the state and
        never says a pause is durable: it is a no-op while the sandbox is bound to that node in
        that state, and otherwise binds it with `durable` false.

        A bind whose `generation` is lower than that of the sandbox's binding to the same node is
        late (read before a change that another bind has reported already) and changes nothing:
        a node's report sent while a gateway's pause ran never undoes the gateway's bind of the
        pause, nor a gateway's bind of a resume the node's report of a later pause."""
        ...

    async def release(self, request: Placement, node_id: str) -> None:
        """Free the room a resume's placement reserved on `node_id` for a take-over that failed
        there (a create's is freed by `unbind`), rather than hold it until it expires. A no-op
        once that room is spent or expired. InvalidRequest for a create's placement."""
        ...

    async def unbind(self, sandbox_id: str, node_id: str) -> None:
        """Forget a sandbox, only if it is still bound to `node_id` (a late call from a node the
        sandbox has left must not remove its new binding). A binding recorded by a create's
        placement takes its reserved room with it (the create failed)."""
        ...

    async def tombstone(self, sandbox_id: str, node_id: str) -> Binding:
        """Kill the sandbox in the cluster's records while `node_id`, its node, cannot be
        reached: unbind it and keep a tombstone of it, in one step, so that no bind (the node's
        report when it is back, a take-over's) brings it back: the node kills it instead. Returns
        the binding it had; NotFound if it is not bound, Conflict if bound to another node now."""
        ...

    async def locate(self, sandbox_id: str) -> tuple[Binding, NodeInfo]:
        """The sandbox's binding and its node. NotFound if unbound."""
        ...

    async def bindings(self, node_id: str | None = None) -> list[Binding]:
        """All bindings, or those a node answers for: `node_id`'s, less the creates placed on
        it that have not ended yet (the node binds those itself when they do)."""
        ...
