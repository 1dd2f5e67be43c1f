"""HTTP `/files` download and upload, with user permissions, gzip, xattr metadata and presigned URLs."""

from __future__ import annotations

import asyncio
import base64
import errno
import hashlib
import hmac
import os
import re
import stat
import time
import zlib
from typing import Any

from aiohttp import web

from .connect import ConnectError
from .entry import write_metadata
from .httperr import UNAUTHORIZED, json_error
from .state import State
from .users import User, default_user, lookup_user, resolve_path, run_as

CHUNK = 256 * 1024
METADATA_PREFIX = "x-metadata-"
_DISPOSITION_PARAM = re.compile(r';\s*([^=;\s]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)')


class HTTPFailure(Exception):
    """Aborts a /files request with a JSON error response."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _os_failure(err: OSError, path: str) -> HTTPFailure:
    if err.errno == errno.ENOENT:
        return HTTPFailure(404, f"path '{path}' does not exist")
    if err.errno in (errno.EACCES, errno.EPERM):
        return HTTPFailure(403, f"permission denied for path '{path}'")
    if err.errno == errno.EISDIR:
        return HTTPFailure(400, f"path '{path}' is a directory")
    if err.errno == errno.ENOTDIR:
        return HTTPFailure(400, f"path '{path}' has a non-directory parent")
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return HTTPFailure(507, "not enough disk space available")
    return HTTPFailure(500, f"error accessing '{path}': {err.strerror or err}")


def _sign(raw: str) -> str:
    digest = hashlib.sha256(raw.encode()).digest()
    return "v1_" + base64.b64encode(digest).decode().rstrip("=")


class FilesAPI:
    def __init__(self, state: State) -> None:
        self.state = state

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/files", self.download), web.post("/files", self.upload)]

    # -- auth / identity ----------------------------------------------------------------------------

    def _authorize(self, request: web.Request, operation: str) -> None:
        """X-Access-Token if sent (must match), otherwise a v1 signature over path/operation/user/token."""
        token = self.state.access_token
        if not token:
            return
        header = request.headers.get("X-Access-Token")
        if header is not None:
            if hmac.compare_digest(header.encode(), token.encode()):
                return
            raise HTTPFailure(401, UNAUTHORIZED)
        query = request.query
        signature = query.get("signature")
        if not signature:
            raise HTTPFailure(401, "missing signature query parameter")
        expiration = query.get("signature_expiration")
        raw = f"{query.get('path', '')}:{operation}:{query.get('username', '')}:{token}"
        if expiration:
            raw += f":{expiration}"
        if not hmac.compare_digest(signature.encode(), _sign(raw).encode()):
            raise HTTPFailure(401, "invalid signature")
        if expiration:
            try:
                expired = int(expiration) < time.time()
            except ValueError:
                raise HTTPFailure(400, "invalid signature_expiration") from None
            if expired:
                raise HTTPFailure(401, "signature is already expired")

    def _user(self, request: web.Request) -> User:
        name = request.query.get("username")
        if not name:
            return default_user(self.state)
        try:
            return lookup_user(name)
        except ConnectError as e:
            raise HTTPFailure(401, e.message) from None

    def _path(self, raw: str, user: User) -> str:
        try:
            return resolve_path(raw, user, self.state.default_workdir)
        except ConnectError as e:
            raise HTTPFailure(400, e.message) from None

    # -- download -----------------------------------------------------------------------------------

    async def download(self, request: web.Request) -> web.StreamResponse:
        try:
            self._authorize(request, "read")
            user = self._user(request)
            raw = request.query.get("path", "")
            if not raw:
                raise HTTPFailure(400, "path query parameter is required")
            path = self._path(raw, user)

            def open_file() -> tuple[int, int]:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                st = os.fstat(fd)
                if stat.S_ISDIR(st.st_mode):
                    os.close(fd)
                    raise IsADirectoryError(errno.EISDIR, "is a directory")
                return fd, st.st_size

            try:
                fd, size = await asyncio.to_thread(run_as, user, open_file)
            except OSError as e:
                raise _os_failure(e, path) from None
        except HTTPFailure as f:
            return json_error(f.status, f.message)
        try:
            return await self._send(request, fd, size, path)
        finally:
            os.close(fd)

    async def _send(self, request: web.Request, fd: int, size: int, path: str) -> web.StreamResponse:
        import mimetypes
        from urllib.parse import quote

        name = os.path.basename(path)
        ctype = mimetypes.guess_type(name)[0] or "application/octet-stream"
        resp = web.StreamResponse(
            headers={
                "Content-Type": ctype,
                "Content-Disposition": f"inline; filename*=UTF-8''{quote(name)}",
                "Vary": "Accept-Encoding",
                "Cache-Control": "no-store",
            }
        )
        compressor = zlib.compressobj(6, zlib.DEFLATED, 31) if _accepts_gzip(request) else None
        if compressor is not None:
            resp.headers["Content-Encoding"] = "gzip"
        else:
            resp.content_length = size
        await resp.prepare(request)

        def next_chunk() -> tuple[bool, bytes]:
            """(eof, bytes to send): read and compress off the event loop."""
            data = os.read(fd, CHUNK)
            if compressor is None:
                return not data, data
            return not data, compressor.compress(data) if data else compressor.flush()

        try:
            while True:
                eof, out = await asyncio.to_thread(next_chunk)
                if out:
                    await resp.write(out)
                if eof:
                    break
            await resp.write_eof()
        except ConnectionError:
            pass
        return resp

    # -- upload -------------------------------------------------------------------------------------

    async def upload(self, request: web.Request) -> web.StreamResponse:
        try:
            self._authorize(request, "write")
            user = self._user(request)
            metadata = _metadata_headers(request)
            query_path = request.query.get("path", "")
            ctype = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
            written: list[dict[str, Any]] = []
            if ctype == "multipart/form-data":
                reader = await request.multipart()
                seen: set[str] = set()
                while True:
                    part = await reader.next()
                    if part is None:
                        break
                    if getattr(part, "name", None) != "file":
                        continue
                    raw = query_path or part_filename(part.headers.get("Content-Disposition", ""))
                    if not raw:
                        raise HTTPFailure(400, "missing file path (filename or path query parameter)")
                    path = self._path(raw, user)
                    if path in seen:
                        raise HTTPFailure(400, f"cannot upload multiple files to the same path '{path}'")
                    seen.add(path)
                    written.append(await self._store(user, path, part.read_chunk, metadata))  # type: ignore[union-attr]
            else:
                if not query_path:
                    raise HTTPFailure(400, "path query parameter is required for octet-stream uploads")
                path = self._path(query_path, user)
                written.append(await self._store(user, path, request.content.read, metadata))
            if not written:
                raise HTTPFailure(400, "no file was uploaded (expected a multipart field named 'file')")
        except HTTPFailure as f:
            return json_error(f.status, f.message)
        return web.json_response(written)

    async def _store(
        self, user: User, path: str, read: Any, metadata: dict[str, str] | None
    ) -> dict[str, Any]:
        """Create parents and the file as the user, stream the body into it, then apply metadata."""

        def open_target() -> int:
            parent = os.path.dirname(path)
            try:
                os.makedirs(parent, exist_ok=True)
            except FileExistsError:
                raise NotADirectoryError(errno.ENOTDIR, "not a directory") from None
            if os.path.isdir(path):
                raise IsADirectoryError(errno.EISDIR, "is a directory")
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)

        try:
            fd = await asyncio.to_thread(run_as, user, open_target)
        except OSError as e:
            raise _os_failure(e, path) from None
        try:
            while True:
                chunk = await read(CHUNK)
                if not chunk:
                    break
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
        except OSError as e:
            raise _os_failure(e, path) from None
        finally:
            os.close(fd)
        info: dict[str, Any] = {"path": path, "name": os.path.basename(path), "type": "file"}
        if metadata is not None:
            try:
                write_metadata(path, metadata)
            except OSError as e:
                raise HTTPFailure(500, f"cannot store metadata on '{path}': {e.strerror or e}") from None
            info["metadata"] = metadata
        return info


def part_filename(disposition: str) -> str:
    """The part's filename *with* its directories (aiohttp strips leading slashes; envd keeps full paths)."""
    from urllib.parse import unquote

    params = {k.lower(): v.strip() for k, v in _DISPOSITION_PARAM.findall(disposition)}
    extended = params.get("filename*")
    if extended and "'" in extended:
        charset, _, value = extended.strip('"').split("'", 2)
        return unquote(value, encoding=charset or "utf-8", errors="replace")
    value = params.get("filename", "")
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = re.sub(r"\\(.)", r"\1", value[1:-1])
    return value


def _accepts_gzip(request: web.Request) -> bool:
    for item in request.headers.get("Accept-Encoding", "").split(","):
        token, _, params = item.strip().partition(";")
        if token.strip().lower() in ("gzip", "*"):
            q = params.strip()
            return not (q.startswith("q=") and float(q[2:] or 0) == 0)
    return False


def _metadata_headers(request: web.Request) -> dict[str, str] | None:
    """`X-Metadata-<key>` headers (key lower-cased, printable ASCII only); None when there are none."""
    out: dict[str, str] = {}
    for name, value in request.headers.items():
        lower = name.lower()
        if not lower.startswith(METADATA_PREFIX):
            continue
        key = lower[len(METADATA_PREFIX) :]
        if not key or not all(32 < ord(c) < 127 for c in key) or not all(31 < ord(c) < 127 for c in value):
            raise HTTPFailure(400, f"invalid metadata header '{name}'")
        out[key] = value
    return out or None
