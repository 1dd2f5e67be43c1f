"""HTTP routes the node's template builds use (``aenv.template.runner``), done by envd itself.

They work in any image: one without ``useradd`` or ``adduser`` (busybox-static), without
``tar``, without a shell at all (distroless), since envd runs on its own runtime.

- ``POST /aenv/build/user`` ``{"name", "sudo"}``: the user exists (``accounts.ensure_user``);
  with ``sudo``, it gets the ``base`` template's passwordless sudo where the image has sudo.
- ``POST /aenv/build/workdir`` ``{"path", "user"}``: the directory exists; created, it is the user's.
- ``POST /aenv/build/copy``: a JSON ``CopyPlan`` line, then the uploaded archive, unpacked as
  it arrives (``copying.unpack``).
- ``POST /aenv/build/image``: what the image lacks that steps may need (``{"shell": bool}``).
- ``POST /aenv/build/sync``: the guest's writes on disk (the node seals a layer next).
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from aiohttp import StreamReader, web

from . import accounts, copying
from .httperr import json_error

SHELL = "/bin/sh"
MAX_PLAN = 32 << 20  # a plan names up to MAX_MEMBERS roots
ERRORS = (accounts.AccountError, copying.CopyError, ValueError, KeyError, TypeError)


def routes() -> list[web.RouteDef]:
    return [
        web.post("/aenv/build/user", _user),
        web.post("/aenv/build/workdir", _workdir),
        web.post("/aenv/build/copy", _copy),
        web.post("/aenv/build/image", _image),
        web.post("/aenv/build/sync", _sync),
    ]


async def _answer(work: Any, *args: Any) -> web.Response:
    try:
        result = await asyncio.to_thread(work, *args)
    except ERRORS as exc:
        return json_error(400, str(exc))
    except OSError as exc:
        return json_error(500, f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "))
    return web.json_response(result)


async def _user(request: web.Request) -> web.Response:
    body = await request.json()

    def work() -> dict[str, Any]:
        account = accounts.ensure_user(body["name"])
        sudo = bool(body.get("sudo")) and accounts.grant_sudo(account.name)
        return {"uid": account.uid, "gid": account.gid, "home": account.home, "sudo": sudo}

    return await _answer(work)


async def _workdir(request: web.Request) -> web.Response:
    body = await request.json()

    def work() -> dict[str, Any]:
        path = body["path"]
        if not isinstance(path, str) or not path.startswith("/"):
            raise ValueError(f"WORKDIR {path!r} is not an absolute path")
        if not os.path.isdir(path):
            uid, gid = accounts.owner(body["user"])
            os.makedirs(path, mode=0o755, exist_ok=True)
            os.chown(path, uid, gid)
        return {"path": path}

    return await _answer(work)


async def _copy(request: web.Request) -> web.Response:
    content = request.content
    head = b""
    while b"\n" not in head:
        chunk = await content.readany()
        if not chunk or len(head) > MAX_PLAN:
            return json_error(400, "the COPY body must start with its plan on one line")
        head += chunk
    line, rest = head.split(b"\n", 1)
    try:
        raw = json.loads(line)
        uid, gid = accounts.owner(raw["chown"]) if raw.get("chown") else (0, 0)
        plan = copying.CopyPlan(
            [(str(name), bool(is_dir)) for name, is_dir in raw["roots"]], str(raw["dest"]),
            uid, gid, raw.get("mode"),
        )  # fmt: skip
    except ERRORS as exc:
        await _discard(content)
        return json_error(400, f"invalid COPY plan: {exc}")
    answer = await _answer(copying.unpack, _Body(rest, content, asyncio.get_running_loop()), plan)
    await _discard(content)  # what an error left unread, so the node reads the answer
    return answer


async def _discard(content: StreamReader) -> None:
    while await content.readany():
        pass


class _Body:
    """The request's body as a blocking file for ``tarfile`` in a worker thread."""

    def __init__(self, first: bytes, content: StreamReader, loop: asyncio.AbstractEventLoop):
        self.pending = first
        self.content = content
        self.loop = loop

    def read(self, size: int = -1) -> bytes:
        if self.pending:
            data, self.pending = self.pending, b""
            return data
        want = size if size > 0 else copying.CHUNK
        return asyncio.run_coroutine_threadsafe(self.content.read(want), self.loop).result()


async def _image(request: web.Request) -> web.Response:
    return web.json_response({"shell": os.access(SHELL, os.X_OK)})


async def _sync(request: web.Request) -> web.Response:
    await asyncio.to_thread(os.sync)
    return web.Response(status=204)
