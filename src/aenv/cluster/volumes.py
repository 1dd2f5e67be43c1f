"""Volumes through a gateway: each volume lives on one node, its home, and the gateway routes the
volume API and the content API there, and places the sandboxes that mount it there.

Why a home node and not the shared repository: a volume promises that what one sandbox writes
is at once what every other sandbox mounting it and the content API read, with POSIX semantics
(renames, appends, ownership), served live over 9P from an ext4 image on the node
(`aenv.volumes`). The shared repository is immutable, content-addressed blobs, committed once and
read many times, with no in-place write and no lock: two nodes writing one volume would need a
distributed filesystem. So a volume is its node's, as a node-local pause is.

The home is carried in the id the gateway answers: `<the node's volume id>-<node id>`, so
routing a volume's call costs no lookup (the node's address comes from the gateway's list of
live nodes) and no state is kept anywhere but on the node, which survives a Redis that lost its
data. A new volume goes to the first up node in the name's rendezvous order (stable, spread),
after every live node was asked whether the name is taken (names are what sandboxes mount
volumes by, so they are unique in the cluster). A create that mounts volumes asks the live nodes
which holds each name, then is placed on that node only.

A volume whose node is down answers 503 with `Retry-After`: it is back with its node. A name
that no live node holds while a node is down is also a 503 (that node may hold it), never a 400.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from ..api.schemas import NewVolume
from ..api.server import Handler, error_response, parse
from ..api.volumes import CHUNK, CONTENT_PREFIX, CONTENT_ROUTES, VolumeAPI
from ..orchestrator.errors import Conflict, InvalidRequest, NotFound, SandboxError, Unavailable
from ..orchestrator.interface import CreateRequest
from .fleet import NodeFleet, rendezvous
from .model import ID_PATTERN, NodeInfo, NodeState
from .remote import node_error

# A volume id as a gateway answers it: the node's own (`aenv.volumes.store.VOLUME_ID`), its node's id.
CLUSTER_VOLUME_ID = re.compile(r"^(vol[a-z0-9]{20})-(" + ID_PATTERN.strip("^$") + ")$")
DOWN_CODE = "volume_node_down"  # the `error_code` of a volume whose node cannot be reached now
RETRY_AFTER = 5  # seconds a client is told to wait before it asks for a volume whose node is away again
# Headers of a content call that go on to the node, and of the node's answer that come back.
FORWARDED = ("Authorization", "Content-Type")
RETURNED = ("Content-Type", "Content-Length")


def cluster_id(volume_id: str, node_id: str) -> str:
    return f"{volume_id}-{node_id}"


def retryable(handler: Handler) -> Handler:
    """A 503 (a volume's node that cannot be reached) says when to retry."""

    async def answer(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except Unavailable as exc:
            response = error_response(503, exc.message, exc.error_code)
            response.headers["Retry-After"] = str(RETRY_AFTER)
            return response

    answer.__name__, answer.__doc__ = handler.__name__, handler.__doc__
    answer.presigned = getattr(handler, "presigned", False)  # type: ignore[attr-defined]
    return answer


async def volume_exclusion(fleet: NodeFleet, request: CreateRequest) -> list[str]:
    """The gateway's placement rule for `ClusterNode`: a create goes where the volumes it mounts are."""
    return await VolumeRouting(fleet).excluded(request)


class VolumeRouting:
    """The volume API of a gateway over `fleet`'s nodes (each node's own `aenv.api.volumes`)."""

    def __init__(self, fleet: NodeFleet):
        self.fleet = fleet
        self.client = fleet.client  # carries the cluster secret
        self.scheduler = fleet.scheduler

    def routes(self) -> list[tuple[str, str, Handler]]:
        content = CONTENT_PREFIX + "{volumeID}"
        table = [
            ("POST", "/volumes", self.create_volume),
            ("GET", "/volumes", self.list_volumes),
            ("GET", "/volumes/{volumeID}", self.get_volume),
            ("DELETE", "/volumes/{volumeID}", self.delete_volume),
            *(
                (method, f"{content}/{kind}", self._content_handler(name))
                for method, kind, name in CONTENT_ROUTES
            ),
        ]
        return [(method, path, retryable(handler)) for method, path, handler in table]

    def _content_handler(self, name: str) -> Handler:
        """The content route `name` (as the node's `VolumeAPI` names it): relayed to the home node,
        whose token check is the credential (no API key, as on a node)."""

        async def relay(request: web.Request) -> web.StreamResponse:
            volume_id, info = await self._home(request.match_info["volumeID"])
            return await self._relay(
                request, info, f"{CONTENT_PREFIX}{volume_id}/{request.path.rsplit('/', 1)[1]}"
            )

        relay.__name__, relay.__doc__ = name, getattr(VolumeAPI, name).__doc__
        relay.presigned = True  # type: ignore[attr-defined]
        return relay

    # -- where volumes are ---------------------------------------------------------------------

    async def _home(self, volume_id: str) -> tuple[str, NodeInfo]:
        """The node's id of the volume and its node, which answers; else why not."""
        match = CLUSTER_VOLUME_ID.match(volume_id)
        if match is None:
            raise NotFound(f"volume {volume_id} not found")
        local, node_id = match.groups()
        info = next((n for n in await self.fleet.live_nodes() if n.node_id == node_id), None)
        if info is None:
            try:
                info = await self.scheduler.node(node_id)
            except NotFound:
                raise NotFound(
                    f"volume {volume_id} not found (its node {node_id} left the cluster)"
                ) from None
            if info.status == NodeState.DOWN and not await self.fleet.remote(info).answers():
                raise Unavailable(
                    f"volume {volume_id} is on node {node_id}, which is down: retry when it is back",
                    DOWN_CODE,
                )
        return local, info

    async def _node_volumes(self) -> tuple[list[tuple[NodeInfo, list[dict[str, Any]]]], list[str]]:
        """Every live node's volumes, and the ids of the nodes that could not say (down or failing)."""
        live = await self.fleet.live_nodes()
        answers = await asyncio.gather(
            *(self._send(n, "GET", "/volumes") for n in live), return_exceptions=True
        )
        found, silent = (
            [],
            [n.node_id for n in await self.scheduler.nodes() if n.status == NodeState.DOWN],
        )
        for info, answer in zip(live, answers, strict=True):
            if isinstance(answer, SandboxError):
                silent.append(info.node_id)
            elif isinstance(answer, BaseException):
                raise answer
            else:
                found.append((info, answer))
        return found, silent

    async def _holder(self, name: str) -> NodeInfo | None:
        """The live node that holds the volume named `name`; None if none does and every node
        answered; 503 if none does while some node could not say."""
        found, silent = await self._node_volumes()
        holders = [info for info, volumes in found if any(v["name"] == name for v in volumes)]
        if holders:
            return holders[0]
        if silent:
            raise Unavailable(
                f"no live node holds volume '{name}', but node(s) {', '.join(sorted(silent))} cannot be "
                "asked and may: retry when they are back", DOWN_CODE,
            )  # fmt: skip
        return None

    async def excluded(self, request: CreateRequest) -> list[str]:
        """The nodes a create must not be placed on: all but the one holding the volumes it mounts."""
        if not request.volume_mounts:
            return []
        homes: dict[str, str] = {}
        for mount in request.volume_mounts:
            info = await self._holder(mount["name"])
            if info is None:
                raise InvalidRequest(f"volume '{mount['name']}' (mounted at {mount['path']}) does not exist")
            if info.status != NodeState.UP:
                raise Unavailable(
                    f"volume '{mount['name']}' is on node {info.node_id}, which is {info.status.value} and "
                    "takes no new sandboxes", DOWN_CODE,
                )  # fmt: skip
            homes[mount["name"]] = info.node_id
        if len(set(homes.values())) > 1:
            where = ", ".join(f"'{name}' on {node}" for name, node in sorted(homes.items()))
            raise InvalidRequest(
                f"a sandbox mounts volumes of one node only, and these are on several: {where}"
            )
        (home,) = set(homes.values())
        return [n.node_id for n in await self.scheduler.nodes() if n.node_id != home]

    # -- control plane ---------------------------------------------------------------------------

    async def create_volume(self, request: web.Request) -> web.Response:
        """Create a volume on the first up node in its name's order; the name is the cluster's."""
        body = await parse(request, NewVolume)
        if await self._holder(body.name) is not None:
            raise Conflict(f"a volume named '{body.name}' already exists")
        up = [n for n in await self.fleet.live_nodes() if n.status == NodeState.UP]
        if not up:
            raise Unavailable("no node is up to hold a volume")
        info = rendezvous(f"volume/{body.name}", up)[0]
        created = await self._send(
            info, "POST", "/volumes", json=body.model_dump(by_alias=True, exclude_none=True)
        )
        return web.json_response(_named(created, info), status=201)

    async def list_volumes(self, request: web.Request) -> web.Response:
        """The live nodes' volumes (a down node's are listed again when it is back)."""
        found, _ = await self._node_volumes()
        return web.json_response([_named(v, info) for info, volumes in found for v in volumes])

    async def get_volume(self, request: web.Request) -> web.Response:
        """A volume with its token."""
        volume_id, info = await self._home(request.match_info["volumeID"])
        return web.json_response(_named(await self._send(info, "GET", f"/volumes/{volume_id}"), info))

    async def delete_volume(self, request: web.Request) -> web.Response:
        """Delete a volume and its files (409 while a sandbox mounts it)."""
        volume_id, info = await self._home(request.match_info["volumeID"])
        await self._send(info, "DELETE", f"/volumes/{volume_id}")
        return web.Response(status=204)

    # -- calls to nodes --------------------------------------------------------------------------

    async def _send(self, info: NodeInfo, method: str, path: str, **kwargs: Any) -> Any:
        """The node's JSON answer (None for an empty one); its errors as the typed errors."""
        try:
            async with self.client.request(method, info.address + path, **kwargs) as answer:
                content = await answer.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _unreachable(info, exc) from exc
        if answer.status >= 400:
            raise node_error(answer.status, content, info.node_id)
        return json.loads(content) if content else None

    async def _relay(self, request: web.Request, info: NodeInfo, path: str) -> web.StreamResponse:
        """The request streamed to the node and its answer streamed back (files of any size)."""
        headers = {name: request.headers[name] for name in FORWARDED if name in request.headers}
        body = _chunks(request.content) if request.body_exists else None
        try:
            answer = await self.client.request(
                request.method, info.address + path, params=request.query, headers=headers, data=body
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _unreachable(info, exc) from exc
        async with answer:
            if answer.status >= 400:
                raise node_error(answer.status, await answer.read(), info.node_id)
            response = web.StreamResponse(status=answer.status)
            response.headers.update({h: answer.headers[h] for h in RETURNED if h in answer.headers})
            await response.prepare(request)
            async for chunk in answer.content.iter_chunked(CHUNK):
                await response.write(chunk)
        await response.write_eof()
        return response


def _unreachable(info: NodeInfo, exc: BaseException) -> Unavailable:
    return Unavailable(
        f"the volume's node {info.node_id} at {info.address} is unreachable ({exc!r}): retry when it is back",
        DOWN_CODE,
    )


async def _chunks(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    while chunk := await content.read(CHUNK):
        yield chunk


def _named(volume: dict[str, Any], info: NodeInfo) -> dict[str, Any]:
    """A node's answer about a volume, with the volume's id as the cluster knows it."""
    return volume | {"volumeID": cluster_id(volume["volumeID"], info.node_id)}
