"""`RemoteNode`: one node's `NodeService`, reached over HTTP from a gateway.

Calls go to the node's internal route (`aenv.cluster.wire`) with the cluster secret; the node's
`{"code", "message"}` errors come back as the typed errors of `aenv.orchestrator.errors` (the
inverse of the API's status table), so the gateway's API answers exactly what the node would
have. A node that cannot be reached is `Unavailable`, naming the node: a create may then be
retried elsewhere, and a client learns which node failed.

Calls go through one aiohttp session per gateway, whose keep-alive connections to each node are
shared by all calls: every create through a gateway makes one, and aiohttp's client costs a
fraction of httpx's CPU per call (about 0.2 against 0.9 ms on a 2-core host).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from ..orchestrator.errors import OperationFailed, Overloaded, SandboxError, Unavailable, parse_retry_after
from ..orchestrator.interface import (
    BuildTicket,
    CreateRequest,
    FanOutRequest,
    FanOutResult,
    FileLink,
    ListQuery,
    NodeStatus,
)
from ..orchestrator.store import SandboxRecord
from ..repository.manifest import SnapshotManifest
from ..snapshot.checkpoints import Checkpoint
from ..template.builds import TagInfo
from ..template.steps import BuildRequest, BuildStart
from . import wire
from .auth import CLUSTER_SECRET_HEADER
from .client import KINDS

CONNECT_TIMEOUT = 5.0
PROBE_TIMEOUT = 2.0  # seconds a node the scheduler has down gets to show it is alive
# A create or resume under TCG on a busy host can take minutes; the node bounds its own work.
CALL_TIMEOUT = 900.0


def cluster_client(secret: str) -> aiohttp.ClientSession:
    """The HTTP client a gateway reaches its nodes with, presenting the cluster secret (made on
    the event loop that uses it).

    Without a cap on its connections: each call holds one for as long as the node works on it
    (a create under TCG with 128 others restoring: about 17 s), and aiohttp's default of 100, whose
    wait counts as connecting, had the 101st of 256 concurrent creates answer 503 "node
    unreachable" after `CONNECT_TIMEOUT`. A node bounds what it takes itself (429 when full)."""
    timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT, sock_connect=CONNECT_TIMEOUT)
    connector = aiohttp.TCPConnector(limit=0)
    return aiohttp.ClientSession(
        headers={CLUSTER_SECRET_HEADER: secret}, timeout=timeout, connector=connector
    )


def node_error(status: int, content: bytes, node_id: str) -> SandboxError:
    """The typed error behind a node's error response."""
    try:
        body = json.loads(content)
        message, code = str(body["message"]), body.get("error_code")
    except (ValueError, KeyError, TypeError, AttributeError):
        text = content.decode(errors="replace")[:200]
        message, code = f"node {node_id} answered {status}: {text}", None
    if status == 401:  # the node refused the gateway itself, not the user
        return OperationFailed(f"node {node_id} refused the gateway's credentials: {message}")
    kind = KINDS.get(status, OperationFailed)
    return kind(message, code)


class RemoteNode:
    """A node's `NodeService` over HTTP (`client` from `cluster_client`, shared by all nodes)."""

    def __init__(self, node_id: str, address: str, client: aiohttp.ClientSession):
        self.node_id = node_id
        self.address = address.rstrip("/")
        self.client = client

    async def _send(self, method: str, path: str, **kwargs: Any) -> bytes:
        """The body of the node's answer; its error answers raise the typed errors."""
        try:
            async with self.client.request(method, self.address + path, **kwargs) as response:
                content = await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise Unavailable(f"node {self.node_id} at {self.address} is unreachable: {exc!r}") from exc
        if response.status >= 400:
            error = node_error(response.status, content, self.node_id)
            if isinstance(error, Overloaded):  # the node's estimate of when it has room again
                error.retry_after = parse_retry_after(response.headers.get("Retry-After"), error.retry_after)
            raise error
        return content

    async def answers(self) -> bool:
        """Whether the node's API answers at all (its `/health`, within `PROBE_TIMEOUT`)."""
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT)
        try:
            async with self.client.get(self.address + "/health", timeout=timeout) as response:
                return response.status < 500
        except (aiohttp.ClientError, TimeoutError):  # refused, reset or timed out
            return False

    async def _call(self, method: str, **arguments: Any) -> Any:
        body = wire.encode_arguments(method, arguments)
        content = await self._send("POST", wire.call_path(method), json=body)
        try:
            return wire.decode_answer(method, content)
        except ValueError as exc:  # pydantic's ValidationError is one
            raise OperationFailed(
                f"node {self.node_id} answered {method} with an unexpected body: {exc}"
            ) from exc

    async def create(self, request: CreateRequest) -> SandboxRecord:
        return await self._call("create", request=request)

    async def get(self, sandbox_id: str) -> SandboxRecord:
        return await self._call("get", sandbox_id=sandbox_id)

    async def list(self, query: ListQuery) -> list[SandboxRecord]:
        return await self._call("list", query=query)

    async def kill(self, sandbox_id: str) -> None:
        await self._call("kill", sandbox_id=sandbox_id)

    async def pause(self, sandbox_id: str, *, memory: bool = True) -> SandboxRecord:
        return await self._call("pause", sandbox_id=sandbox_id, memory=memory)

    async def connect(
        self, sandbox_id: str, timeout: int | None, *, memory: bool = True
    ) -> tuple[SandboxRecord, bool]:
        return await self._call("connect", sandbox_id=sandbox_id, timeout=timeout, memory=memory)

    async def resume(self, sandbox_id: str, timeout: int | None, *, memory: bool = True) -> SandboxRecord:
        return await self._call("resume", sandbox_id=sandbox_id, timeout=timeout, memory=memory)

    async def take_over(self, sandbox_id: str, timeout: int | None) -> SandboxRecord:
        return await self._call("take_over", sandbox_id=sandbox_id, timeout=timeout)

    async def discard_pause(self, sandbox_id: str) -> None:
        await self._call("discard_pause", sandbox_id=sandbox_id)

    async def set_timeout(self, sandbox_id: str, timeout: int) -> None:
        await self._call("set_timeout", sandbox_id=sandbox_id, timeout=timeout)

    async def refresh(self, sandbox_id: str, duration: int | None) -> None:
        await self._call("refresh", sandbox_id=sandbox_id, duration=duration)

    async def snapshot(self, sandbox_id: str, name: str | None, *, memory: bool = True) -> SnapshotManifest:
        return await self._call("snapshot", sandbox_id=sandbox_id, name=name, memory=memory)

    async def fork(self, sandbox_id: str, count: int, timeout: int | None) -> list[SandboxRecord]:
        return await self._call("fork", sandbox_id=sandbox_id, count=count, timeout=timeout)

    async def update_network(
        self, sandbox_id: str, allow_internet: bool | None, network: dict[str, Any]
    ) -> None:
        arguments = {"allow_internet": allow_internet, "network": network}
        await self._call("update_network", sandbox_id=sandbox_id, **arguments)

    async def fan_out(self, request: FanOutRequest) -> list[FanOutResult]:
        return await self._call("fan_out", request=request)

    async def checkpoint(self, sandbox_id: str, name: str | None) -> Checkpoint:
        return await self._call("checkpoint", sandbox_id=sandbox_id, name=name)

    async def checkpoints(self, sandbox_id: str) -> list[Checkpoint]:
        return await self._call("checkpoints", sandbox_id=sandbox_id)

    async def delete_checkpoint(self, sandbox_id: str, checkpoint: str) -> None:
        await self._call("delete_checkpoint", sandbox_id=sandbox_id, checkpoint=checkpoint)

    async def promote_checkpoint(
        self, sandbox_id: str, checkpoint: str, name: str | None
    ) -> SnapshotManifest:
        return await self._call("promote_checkpoint", sandbox_id=sandbox_id, checkpoint=checkpoint, name=name)

    async def reset(self, sandbox_id: str, checkpoint: str) -> SandboxRecord:
        return await self._call("reset", sandbox_id=sandbox_id, checkpoint=checkpoint)

    async def metrics(self, sandbox_id: str, start: int | None, end: int | None) -> list[dict[str, Any]]:
        return await self._call("metrics", sandbox_id=sandbox_id, start=start, end=end)

    async def latest_metrics(self, sandbox_ids: list[str]) -> dict[str, dict[str, Any]]:
        return await self._call("latest_metrics", sandbox_ids=sandbox_ids)

    async def logs(self, sandbox_id: str, start: int, limit: int) -> tuple[int, list[str]]:
        return await self._call("logs", sandbox_id=sandbox_id, start=start, limit=limit)

    async def catalog(self, kind: str | None = None) -> list[SnapshotManifest]:
        return await self._call("catalog", kind=kind)

    async def find(self, reference: str, kind: str | None = None) -> SnapshotManifest:
        return await self._call("find", reference=reference, kind=kind)

    async def delete_template(self, reference: str) -> None:
        await self._call("delete_template", reference=reference)

    async def status(self) -> NodeStatus:
        return await self._call("status")

    async def request_template_build(self, request: BuildRequest) -> BuildTicket:
        return await self._call("request_template_build", request=request)

    async def template_file(self, template_id: str, files_hash: str) -> FileLink:
        return await self._call("template_file", template_id=template_id, files_hash=files_hash)

    async def receive_template_file(
        self,
        template_id: str,
        files_hash: str,
        expires: str,
        signature: str,
        chunks: AsyncIterator[bytes],
        size: int | None,
    ) -> None:
        """Stream the upload on to the node's presigned URL, which checks it as for a client."""
        headers = {"Content-Length": str(size)} if size is not None else {}
        path = f"/templates/{template_id}/files/{files_hash}"
        params = {"expires": expires, "signature": signature}
        await self._send("PUT", path, params=params, data=chunks, headers=headers)

    async def start_template_build(self, template_id: str, build_id: str, start: BuildStart) -> None:
        await self._call("start_template_build", template_id=template_id, build_id=build_id, start=start)

    async def template_build_status(
        self, template_id: str, build_id: str, offset: int, limit: int
    ) -> dict[str, Any]:
        return await self._call(
            "template_build_status", template_id=template_id, build_id=build_id, offset=offset, limit=limit
        )

    async def assign_template_tags(self, target: str, tags: list[str]) -> tuple[str, list[str]]:
        return await self._call("assign_template_tags", target=target, tags=tags)

    async def remove_template_tags(self, name: str, tags: list[str]) -> None:
        await self._call("remove_template_tags", name=name, tags=tags)

    async def template_tags(self, reference: str) -> list[TagInfo]:
        return await self._call("template_tags", reference=reference)
