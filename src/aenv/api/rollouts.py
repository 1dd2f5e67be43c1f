"""aenv's rollout extensions on the wire: fan-out, checkpoints and reset.

- `POST /sandboxes/fanout`: a create's body plus `count` (1-1,000) and an optional
  `idempotencyKey`; answered 201 with one entry per sandbox, in order, each `{"sandbox": Sandbox}`
  (as create's) or `{"error": {"code", "message"}}` (the status the same failure of a create
  would have), like the fork's `SandboxForkResult`.
- `POST /sandboxes/{sandboxID}/checkpoints` (`{"name"}` optional) → 201 `Checkpoint`;
  `GET` lists them, oldest first; `DELETE .../checkpoints/{checkpointID}` (id or name) → 204.
- `POST /sandboxes/{sandboxID}/checkpoints/{checkpointID}/snapshot` (`{"name"}` optional) → 201
  with the snapshot (as a sandbox's snapshot answers it), recording the checkpoint in its source.
- `POST /sandboxes/{sandboxID}/reset` `{"checkpoint": id or name}` → 200 with the sandbox (as
  connect's: same id, tokens and domain).

The node service does the work (`NodeService.fan_out`, `checkpoint`, `reset`); this module
only maps the wire to its calls.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel

from ..orchestrator import errors
from ..orchestrator.ids import catalog_name
from ..orchestrator.interface import CreateRequest, FanOutRequest, FanOutResult, NodeService
from ..snapshot.checkpoints import Checkpoint
from . import schemas, views
from .status import status_of

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
B = TypeVar("B", bound=BaseModel)
Parser = Callable[..., Awaitable[Any]]
CreateOptions = Callable[..., CreateRequest]
# For the OpenAPI document (aenv.api.openapi).
BODIES: dict[str, type[BaseModel]] = {
    "fan_out": schemas.FanOut,
    "create_checkpoint": schemas.CheckpointRequest,
    "reset": schemas.ResetRequest,
    "promote_checkpoint": schemas.CheckpointSnapshotRequest,
}
REQUIRED = ("fan_out", "reset")
SUCCESS = {
    "fan_out": "201",
    "create_checkpoint": "201",
    "delete_checkpoint": "204",
    "promote_checkpoint": "201",
}
KINDS = {kind.__name__: kind for kind in vars(errors).values() if isinstance(kind, type)}


def checkpoint_view(checkpoint: Checkpoint) -> dict[str, Any]:
    fields = asdict(checkpoint)
    return {
        "checkpointID": fields["checkpoint_id"],
        "sandboxID": fields["sandbox_id"],
        "name": fields["name"],
        "createdAt": fields["created_at"],
        "parent": fields["parent"],
        "snapshotID": fields["snapshot_id"],
        "pages": fields["pages"],
        "memoryMB": fields["memory_mb"],
    }


def routes(
    node: NodeService, parse: Parser, create_request: CreateOptions, domain: str
) -> list[tuple[str, str, Handler]]:
    """The routes, handled through `node`; `parse` is the API's body parser, `create_request`
    its create options from a create's body."""
    api = RolloutAPI(node, parse, create_request, domain)
    return [
        ("POST", "/sandboxes/fanout", api.fan_out),
        ("POST", "/sandboxes/{sandboxID}/checkpoints", api.create_checkpoint),
        ("GET", "/sandboxes/{sandboxID}/checkpoints", api.list_checkpoints),
        ("DELETE", "/sandboxes/{sandboxID}/checkpoints/{checkpointID}", api.delete_checkpoint),
        ("POST", "/sandboxes/{sandboxID}/checkpoints/{checkpointID}/snapshot", api.promote_checkpoint),
        ("POST", "/sandboxes/{sandboxID}/reset", api.reset),
    ]


class RolloutAPI:
    def __init__(self, node: NodeService, parse: Parser, create_request: CreateOptions, domain: str):
        self.node = node
        self.parse = parse
        self.create_request = create_request
        self.domain = domain

    def _result(self, result: FanOutResult) -> dict:
        if result.sandbox is not None:
            return {"sandbox": views.sandbox(result.sandbox, self.domain)}
        assert result.error is not None
        error = KINDS.get(result.error.kind, errors.OperationFailed)(result.error.message)
        return {"error": {"code": status_of(error), "message": result.error.message}}

    async def fan_out(self, request: web.Request) -> web.Response:
        """Start count sandboxes from one template or snapshot, each succeeding or failing alone"""
        body = await self.parse(request, schemas.FanOut)
        options = self.create_request(body, secure=True)
        fan = FanOutRequest(create=options, count=body.count, idempotency_key=body.idempotency_key)
        results = await self.node.fan_out(fan)
        return web.json_response([self._result(r) for r in results], status=201)

    async def create_checkpoint(self, request: web.Request) -> web.Response:
        """Checkpoint a running sandbox (memory and disk), kept while it lives"""
        body = await self.parse(request, schemas.CheckpointRequest, required=False)
        checkpoint = await self.node.checkpoint(request.match_info["sandboxID"], body.name)
        return web.json_response(checkpoint_view(checkpoint), status=201)

    async def list_checkpoints(self, request: web.Request) -> web.Response:
        """The sandbox's checkpoints, oldest first"""
        found = await self.node.checkpoints(request.match_info["sandboxID"])
        return web.json_response([checkpoint_view(c) for c in found])

    async def delete_checkpoint(self, request: web.Request) -> web.Response:
        """Delete a checkpoint (by id or name)"""
        await self.node.delete_checkpoint(request.match_info["sandboxID"], request.match_info["checkpointID"])
        return web.Response(status=204)

    async def promote_checkpoint(self, request: web.Request) -> web.Response:
        """Make a snapshot of a checkpoint, to start sandboxes from"""
        body = await self.parse(request, schemas.CheckpointSnapshotRequest, required=False)
        sandbox_id, checkpoint = request.match_info["sandboxID"], request.match_info["checkpointID"]
        manifest = await self.node.promote_checkpoint(
            sandbox_id, checkpoint, body.name and catalog_name(body.name)
        )
        return web.json_response(views.snapshot_info(manifest), status=201)

    async def reset(self, request: web.Request) -> web.Response:
        """Restore a running sandbox to a checkpoint: same id, URL and tokens"""
        body = await self.parse(request, schemas.ResetRequest)
        record = await self.node.reset(request.match_info["sandboxID"], body.checkpoint)
        return web.json_response(views.sandbox(record, self.domain))
