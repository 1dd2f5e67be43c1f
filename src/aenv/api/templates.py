"""The E2B template build API on the wire, as the official SDKs drive it.

``POST /v3/templates`` registers a build, ``GET /templates/{id}/files/{hash}`` hands out an
upload URL for a ``COPY``'s files (served here: ``PUT`` to the same path with the URL's expiry
and signature, no API key), ``POST /v2/templates/{id}/builds/{buildID}`` starts the build with
its steps, and ``GET .../status`` is polled for logs until ``ready`` or ``error``. Tags are
``POST|DELETE /templates/tags`` and ``GET /templates/{id}/tags``. Everything is done by the
node service; this module only maps the wire to its calls.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar
from urllib.parse import urlencode

from aiohttp import web
from pydantic import BaseModel

from ..orchestrator.errors import InvalidRequest
from ..orchestrator.interface import NodeService
from ..template.steps import FILES_HASH, BuildRequest, BuildStart, TagsRequest, UntagRequest

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
B = TypeVar("B", bound=BaseModel)
Parser = Callable[[web.Request, type[B]], Awaitable[B]]
UPLOAD_CHUNK = 1 << 20
# For the OpenAPI document (aenv.api.openapi): request bodies, success statuses, path parameters.
BODIES: dict[str, type[BaseModel]] = {
    "request_build": BuildRequest,
    "start_build": BuildStart,
    "assign_tags": TagsRequest,
    "remove_tags": UntagRequest,
}
SUCCESS = {"request_build": "202", "file_upload_link": "201", "start_build": "202", "assign_tags": "201"}
SUCCESS |= {"remove_tags": "204"}
PATH_SCHEMAS = {"hash": {"type": "string", "pattern": FILES_HASH.pattern}}


def routes(node: NodeService, parse: Parser) -> list[tuple[str, str, Handler]]:
    """The routes, handled through `node`; `parse` is the API's JSON body parser."""
    api = TemplateBuildAPI(node, parse)
    return [
        ("POST", "/v3/templates", api.request_build),
        ("GET", "/templates/{templateID}/files/{hash}", api.file_upload_link),
        ("PUT", "/templates/{templateID}/files/{hash}", api.upload_files),
        ("POST", "/v2/templates/{templateID}/builds/{buildID}", api.start_build),
        ("GET", "/templates/{templateID}/builds/{buildID}/status", api.build_status),
        ("POST", "/templates/tags", api.assign_tags),
        ("DELETE", "/templates/tags", api.remove_tags),
        ("GET", "/templates/{templateID}/tags", api.list_tags),
    ]


class TemplateBuildAPI:
    """The template build routes: each maps the wire to one `NodeService` call (the builds are
    `aenv.template.builds`, their VMs the engine's)."""

    def __init__(self, node: NodeService, parse: Parser):
        self.node = node
        self.parse = parse

    async def request_build(self, request: web.Request) -> web.Response:
        """Register a template build (``name[:tag]``); its steps follow."""
        body = await self.parse(request, BuildRequest)
        ticket = await self.node.request_template_build(body)
        return web.json_response(
            {
                "templateID": ticket.template_id,
                "buildID": ticket.build_id,
                "public": False,
                "names": [ticket.template_id],
                "tags": ticket.tags,
                "aliases": [ticket.template_id],
            },
            status=202,
        )

    async def file_upload_link(self, request: web.Request) -> web.Response:
        """Whether a COPY's files are here already, else where to upload them."""
        template_id, files_hash = request.match_info["templateID"], request.match_info["hash"]
        link = await self.node.template_file(template_id, files_hash)
        if link.present:
            return web.json_response({"present": True}, status=201)
        query = urlencode({"expires": link.expires, "signature": link.signature})
        url = f"{request.url.origin()}{request.rel_url.path}?{query}"
        return web.json_response({"present": False, "url": url}, status=201)

    async def upload_files(self, request: web.Request) -> web.Response:
        """Receive a COPY's files at a presigned URL (no API key: the signature is the credential)."""
        template_id, files_hash = request.match_info["templateID"], request.match_info["hash"]

        async def chunks() -> AsyncIterator[bytes]:
            while chunk := await request.content.read(UPLOAD_CHUNK):
                yield chunk

        await self.node.receive_template_file(
            template_id,
            files_hash,
            request.query.get("expires", ""),
            request.query.get("signature", ""),
            chunks(),
            request.content_length,
        )
        return web.Response(status=200)

    upload_files.presigned = True  # type: ignore[attr-defined]  # the API key check skips it

    async def start_build(self, request: web.Request) -> web.Response:
        """Start a registered build with its steps; poll its status for progress."""
        template_id, build_id = request.match_info["templateID"], request.match_info["buildID"]
        await self.node.template_build_status(template_id, build_id, 0, 0)  # unknown: 404 before the body
        body = await self.parse(request, BuildStart)
        await self.node.start_template_build(template_id, build_id, body)
        return web.Response(status=202)

    async def build_status(self, request: web.Request) -> web.Response:
        """A build's status and its log entries from ``logsOffset`` on."""
        offset = _count(request, "logsOffset", 0)
        limit = _count(request, "limit", 100)
        body = await self.node.template_build_status(
            request.match_info["templateID"], request.match_info["buildID"], offset, limit
        )
        return web.json_response(body)

    async def assign_tags(self, request: web.Request) -> web.Response:
        """Point more tags at the build ``target`` (``name:tag``) names."""
        body = await self.parse(request, TagsRequest)
        build_id, tags = await self.node.assign_template_tags(body.target, body.tags)
        return web.json_response({"buildID": build_id, "tags": tags}, status=201)

    async def remove_tags(self, request: web.Request) -> web.Response:
        """Remove tags from a template (its builds no tag points at are deleted)."""
        body = await self.parse(request, UntagRequest)
        await self.node.remove_template_tags(body.name, body.tags)
        return web.Response(status=204)

    async def list_tags(self, request: web.Request) -> web.Response:
        """A template's tags and the builds they point at."""
        tags = await self.node.template_tags(request.match_info["templateID"])
        return web.json_response(
            [{"tag": t.tag, "buildID": t.build_id, "createdAt": t.created_at} for t in tags]
        )


def _count(request: web.Request, name: str, default: int) -> int:
    value = request.query.get(name)
    if value is None:
        return default
    if not value.isdigit() or int(value) > 1 << 40:
        raise InvalidRequest(f"{name} must be a non-negative integer")
    return int(value)
