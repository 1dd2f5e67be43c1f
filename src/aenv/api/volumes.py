"""E2B volumes on the wire, as SDK 2.63's `Volume` drives them.

Control plane (API key): `POST|GET /volumes`, `GET|DELETE /volumes/{volumeID}`. Content API,
whose credential is the volume's token (`Authorization: Bearer`, no API key; the SDK sends it
to `E2B_VOLUME_API_URL`, which is this node): under `/volumecontent/{volumeID}/` `dir` (list,
make), `path` (stat, metadata, remove) and `file` (read, write), each with a `path` query.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..orchestrator.errors import InvalidRequest
from ..volumes.content import CHUNK, MAX_DEPTH, Owner, VolumeContent
from ..volumes.store import Volume, VolumeStore
from .schemas import NewVolume, VolumeMetadata

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
B = TypeVar("B", bound=BaseModel)
Parser = Callable[[web.Request, type[B]], Awaitable[B]]
# For the OpenAPI document (aenv.api.openapi).
BODIES: dict[str, type[BaseModel]] = {"create_volume": NewVolume, "update_entry": VolumeMetadata}
SUCCESS = {"create_volume": "201", "delete_volume": "204", "make_dir": "201", "write_file": "201"}
SUCCESS |= {"remove_entry": "204"}
CONTENT_PREFIX = "/volumecontent/"
# The content API: method, path under `/volumecontent/{volumeID}/`, handler (also a gateway's,
# `aenv.cluster.volumes`).
CONTENT_ROUTES = [
    ("GET", "dir", "list_dir"), ("POST", "dir", "make_dir"), ("GET", "path", "stat_entry"),
    ("PATCH", "path", "update_entry"), ("DELETE", "path", "remove_entry"), ("GET", "file", "read_file"),
    ("PUT", "file", "write_file"),
]  # fmt: skip


class ContentQuery(BaseModel):
    """The content API's query parameters (strings on the wire, converted here)."""

    model_config = ConfigDict(extra="ignore")

    path: str = Field(min_length=1, max_length=4096)
    depth: int = Field(default=1, ge=1, le=MAX_DEPTH)
    uid: int | None = Field(default=None, ge=0, le=2**32 - 1)
    gid: int | None = Field(default=None, ge=0, le=2**32 - 1)
    mode: int | None = Field(default=None, ge=0, le=0o7777)
    force: bool = False

    def owner(self) -> Owner:
        return Owner(self.uid, self.gid, self.mode)


_QUERY_SCHEMA = ContentQuery.model_json_schema()["properties"]
QUERY_PARAMETERS: dict[str, list[dict[str, Any]]] = {
    name: [
        {"name": field, "in": "query", "required": field == "path", "schema": _QUERY_SCHEMA[field]}
        for field in fields
    ]
    for name, fields in {
        "list_dir": ("path", "depth"),
        "make_dir": ("path", "uid", "gid", "mode", "force"),
        "stat_entry": ("path",),
        "update_entry": ("path",),
        "remove_entry": ("path",),
        "read_file": ("path",),
        "write_file": ("path", "uid", "gid", "mode", "force"),
    }.items()
}


def _volume(volume: Volume, *, token: bool) -> dict[str, Any]:
    body = {"volumeID": volume.volume_id, "name": volume.name, "sizeMiB": volume.size_mib}
    return body | {"token": volume.token} if token else body


def routes(store: VolumeStore, parse: Parser) -> list[tuple[str, str, Handler]]:
    """The routes over `store`; `parse` is the API's JSON body parser."""
    api = VolumeAPI(store, parse)
    content = CONTENT_PREFIX + "{volumeID}"
    return [
        ("POST", "/volumes", api.create_volume),
        ("GET", "/volumes", api.list_volumes),
        ("GET", "/volumes/{volumeID}", api.get_volume),
        ("DELETE", "/volumes/{volumeID}", api.delete_volume),
        *((method, f"{content}/{kind}", getattr(api, name)) for method, kind, name in CONTENT_ROUTES),
    ]


class VolumeAPI:
    def __init__(self, store: VolumeStore, parse: Parser):
        self.store = store
        self.parse = parse

    # -- control plane ---------------------------------------------------------------------

    async def create_volume(self, request: web.Request) -> web.Response:
        """Create a volume; the answer carries its token for the content API."""
        body = await self.parse(request, NewVolume)
        volume = await asyncio.to_thread(self.store.create, body.name, body.size_mib)
        return web.json_response(_volume(volume, token=True), status=201)

    async def list_volumes(self, request: web.Request) -> web.Response:
        """The node's volumes, oldest first."""
        volumes = await asyncio.to_thread(self.store.all)
        return web.json_response([_volume(v, token=False) for v in volumes])

    async def get_volume(self, request: web.Request) -> web.Response:
        """A volume with its token."""
        return web.json_response(_volume(self.store.get(request.match_info["volumeID"]), token=True))

    async def delete_volume(self, request: web.Request) -> web.Response:
        """Delete a volume and its files (409 while a sandbox mounts it)."""
        await asyncio.to_thread(self.store.delete, request.match_info["volumeID"])
        return web.Response(status=204)

    # -- content ---------------------------------------------------------------------------

    def _open(self, request: web.Request) -> tuple[VolumeContent, ContentQuery]:
        volume = self.store.authorized(request.match_info["volumeID"], request.headers.get("Authorization"))
        try:
            query = ContentQuery.model_validate(dict(request.query))
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(p) for p in error["loc"])
            raise InvalidRequest(f"query parameter {where}: {error['msg']}") from None
        return VolumeContent(self.store.data(volume), self.store.ids), query

    async def list_dir(self, request: web.Request) -> web.Response:
        """The entries of a directory, `depth` levels deep."""
        content, query = self._open(request)
        return web.json_response(await asyncio.to_thread(content.list, query.path, query.depth))

    async def make_dir(self, request: web.Request) -> web.Response:
        """Create a directory (`force`: with its missing parents)."""
        content, query = self._open(request)
        entry = content.make_dir(query.path, parents=query.force, owner=query.owner())
        return web.json_response(entry, status=201)

    async def stat_entry(self, request: web.Request) -> web.Response:
        """A file's or directory's type, size, owner, mode and times."""
        content, query = self._open(request)
        return web.json_response(content.stat(query.path))

    async def update_entry(self, request: web.Request) -> web.Response:
        """Set a file's or directory's owner and mode."""
        content, query = self._open(request)
        body = await self.parse(request, VolumeMetadata)
        return web.json_response(content.update(query.path, Owner(body.uid, body.gid, body.mode)))

    async def remove_entry(self, request: web.Request) -> web.Response:
        """Remove a file, or a directory with everything in it."""
        content, query = self._open(request)
        await asyncio.to_thread(content.remove, query.path)
        return web.Response(status=204)

    async def read_file(self, request: web.Request) -> web.StreamResponse:
        """A file's bytes, streamed."""
        content, query = self._open(request)
        fd, size = content.open_file(query.path)
        try:
            response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            response.content_length = size
            await response.prepare(request)
            while chunk := await asyncio.to_thread(os.read, fd, CHUNK):
                await response.write(chunk)
            await response.write_eof()
            return response
        finally:
            os.close(fd)

    async def write_file(self, request: web.Request) -> web.Response:
        """Write a file from the request body (`force`: create missing parent directories)."""
        content, query = self._open(request)

        async def chunks() -> AsyncIterator[bytes]:
            while chunk := await request.content.read(CHUNK):
                yield chunk

        entry = await content.write_file(query.path, chunks(), parents=query.force, owner=query.owner())
        return web.json_response(entry, status=201)


# The API key check skips the content API: the volume's token is its credential (checked in `_open`).
for _name in QUERY_PARAMETERS:
    getattr(VolumeAPI, _name).presigned = True
