"""HTTP `/files` download and upload, with user permissions, gzip, xattr metadata and presigned URLs."""

from __future__ import annotations

import asyncio
import base64
import errno
import hashlib
import logging
import os
import re
import stat
import time
import zlib
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from .connect import ConnectError
from .entry import XATTR_PREFIX, read_metadata, write_metadata
from .httperr import UNAUTHORIZED, json_error
from .state import State, same_secret
from .users import User, default_user, lookup_user, resolve_path, run_as

CHUNK = 256 * 1024
XATTR_NAME_MAX = 255
DISK_FULL_MARGIN = 1 << 20
METADATA_PREFIX = "x-metadata-"
log = logging.getLogger(__name__)
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
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return HTTPFailure(403, f"permission denied for path '{path}': {err.strerror}")
    if err.errno == errno.EISDIR:
        return HTTPFailure(400, f"path '{path}' is a directory")
    if err.errno == errno.ENOTDIR:
        return HTTPFailure(400, f"path '{path}' has a non-directory parent")
    if err.errno in (errno.ENAMETOOLONG, errno.ELOOP, errno.EINVAL, errno.ENXIO):
        return HTTPFailure(400, f"invalid path '{path}': {err.strerror}")
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
            if same_secret(header, token):
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
        if not same_secret(signature, _sign(raw)):
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
                fd = _open_data(path, os.O_RDONLY)
                return fd, os.fstat(fd).st_size

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
            try:
                written = await self._receive(request, user, metadata)
            except (ValueError, HttpProcessingError, web.RequestPayloadError) as e:
                raise HTTPFailure(400, f"invalid request body: {e}") from None
            if not written:
                raise HTTPFailure(400, "no file was uploaded (expected a multipart field named 'file')")
        except HTTPFailure as f:
            return json_error(f.status, f.message)
        return web.json_response(written)

    async def _receive(
        self, request: web.Request, user: User, metadata: dict[str, str]
    ) -> list[dict[str, Any]]:
        """Store every file of a multipart body, or the one raw body, in order."""
        query_path = request.query.get("path", "")
        ctype = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if ctype != "multipart/form-data":
            if not query_path:
                raise HTTPFailure(400, "path query parameter is required for octet-stream uploads")
            return [await self._store(user, self._path(query_path, user), request.content.read, metadata)]
        written: list[dict[str, Any]] = []
        reader = await request.multipart()
        seen: set[str] = set()
        while (part := await reader.next()) is not None:
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
        return written

    async def _store(self, user: User, path: str, read: Any, metadata: dict[str, str]) -> dict[str, Any]:
        """Write one file the way E2B's envd does, with the user's permissions.

        Parents are created and the file opened as the user; the file is then given to the user and
        their group (the chown E2B's envd does, which watchers report as CHMOD after the CREATE), the
        body streamed in (WRITE), and the file's metadata replaced by the request's: a write without
        metadata clears what an earlier write left. The answer reports the metadata as stored."""

        def open_target() -> int:
            parent = os.path.dirname(path)
            try:
                os.makedirs(parent, exist_ok=True)
            except FileExistsError:
                raise NotADirectoryError(errno.ENOTDIR, "not a directory") from None
            return _open_data(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)

        try:
            fd = await asyncio.to_thread(run_as, user, open_target)
        except OSError as e:
            raise _os_failure(e, path) from None
        try:
            if os.geteuid() == 0:
                os.fchown(fd, user.uid, user.gid)
            while chunk := await read(CHUNK):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
            _store_metadata(fd, path, metadata)
        except OSError as e:
            raise _os_failure(e, path) from None
        finally:
            os.close(fd)
        info: dict[str, Any] = {"path": path, "name": os.path.basename(path), "type": "file"}
        if stored := read_metadata(path):
            info["metadata"] = stored
        return info


def _open_data(path: str, flags: int) -> int:
    """Open a file whose bytes are to be read or written whole; never block on a FIFO.

    Opening a FIFO that has no peer blocks, and would hold one of envd's few worker threads for
    good, so the open is non-blocking and FIFOs, sockets and directories are refused."""
    fd = os.open(path, flags | os.O_CLOEXEC | os.O_NONBLOCK, 0o666)
    mode = os.fstat(fd).st_mode
    if stat.S_ISDIR(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory")
        raise OSError(errno.EINVAL, "not a regular file")
    os.set_blocking(fd, True)
    return fd


def _store_metadata(fd: int, path: str, metadata: dict[str, str]) -> None:
    """Replace the metadata of the open file; where xattrs are unsupported it has none to keep."""
    try:
        write_metadata(fd, metadata)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            if metadata:
                log.warning("metadata of %s not stored: the filesystem has no user xattrs", path)
            return
        if e.errno in (errno.ENOSPC, errno.EDQUOT) and _disk_full(path):
            raise HTTPFailure(507, "not enough space for file metadata") from None
        if e.errno in (errno.ENOSPC, errno.E2BIG, errno.ERANGE):
            raise HTTPFailure(400, "metadata too large to store with the file") from None
        raise _os_failure(e, path) from None


def _disk_full(path: str) -> bool:
    """Whether an ENOSPC means the filesystem is full, not that the file's xattr space is."""
    try:
        st = os.statvfs(path)
    except OSError:
        return True
    return st.f_bavail * st.f_frsize < DISK_FULL_MARGIN


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
            if not q.startswith("q="):
                return True
            try:
                return float(q[2:] or 0) > 0
            except ValueError:  # a malformed weight: RFC 9110 says ignore it
                return True
    return False


def _metadata_headers(request: web.Request) -> dict[str, str]:
    """`X-Metadata-<key>` headers (key lower-cased, printable ASCII only; a key must fit an xattr name)."""
    out: dict[str, str] = {}
    for name, value in request.headers.items():
        lower = name.lower()
        if not lower.startswith(METADATA_PREFIX):
            continue
        key = lower[len(METADATA_PREFIX) :]
        if not key or not all(32 < ord(c) < 127 for c in key) or not all(31 < ord(c) < 127 for c in value):
            raise HTTPFailure(400, f"invalid metadata header '{name[:128]}'")
        if len(XATTR_PREFIX) + len(key) > XATTR_NAME_MAX:
            raise HTTPFailure(
                400, f"metadata key longer than {XATTR_NAME_MAX - len(XATTR_PREFIX)} characters"
            )
        out[key] = value
    return out
