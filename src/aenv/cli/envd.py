"""envd (the daemon inside every sandbox) reached through the node's proxy, as the E2B SDK reaches it.

Requests go to the server's own URL with the `E2b-Sandbox-Id`/`E2b-Sandbox-Port` routing headers (the
SDK's single-URL mode), so the CLI needs nothing but HTTP to the server. RPCs use the Connect protocol
with the JSON codec: unary calls are plain JSON POSTs, streams are 5-byte-framed envelopes.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from .. import __version__
from ..agent.envd import ENVD_PORT
from ..agent.envd.framing import FLAG_END_STREAM, envelope, envelopes
from .api import unreachable
from .config import CLIError

# envd sends a keepalive this often on idle streams; a stream silent for READ_TIMEOUT is dead.
KEEPALIVE_S = 15
READ_TIMEOUT = 60.0


class EnvdError(CLIError):
    """An RPC or file request failed inside the sandbox; `rpc_code` is the Connect code."""

    def __init__(self, rpc_code: str, message: str) -> None:
        super().__init__(message)
        self.rpc_code = rpc_code


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text + "=" * (-len(text) % 4))


def _error(sandbox_id: str, response: httpx.Response, body: bytes) -> EnvdError:
    try:
        decoded = json.loads(body)
    except ValueError:
        decoded = None
    message = body.decode(errors="replace").strip() or response.reason_phrase
    code = "unknown"
    if isinstance(decoded, dict):
        message = str(decoded.get("message") or message)
        code = str(decoded.get("code") or code)
    if response.status_code == 502 and "not found" in message:
        return EnvdError("unavailable", f"sandbox {sandbox_id} is not running (it is paused or gone)")
    return EnvdError(code, f"{message.rstrip('.')} (sandbox {sandbox_id}, HTTP {response.status_code})")


class Envd:
    """One sandbox's envd; `user` picks the Linux user (envd's default, `user`, when None)."""

    def __init__(self, url: str, sandbox: dict[str, Any], user: str | None = None) -> None:
        self.url = url
        self.sandbox_id = str(sandbox["sandboxID"])
        headers = {
            "E2b-Sandbox-Id": self.sandbox_id,
            "E2b-Sandbox-Port": str(ENVD_PORT),
            "User-Agent": f"aenv-cli/{__version__}",
        }
        if sandbox.get("envdAccessToken"):
            headers["X-Access-Token"] = sandbox["envdAccessToken"]
        self.user = user
        self.http = httpx.AsyncClient(
            base_url=url, headers=headers, timeout=httpx.Timeout(60.0, connect=10.0)
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    def _user_header(self) -> dict[str, str]:
        if self.user is None:
            return {}
        return {"Authorization": "Basic " + b64(f"{self.user}:".encode())}

    async def unary(self, method: str, body: dict[str, Any], *, as_user: bool = False) -> dict[str, Any]:
        headers = {"Content-Type": "application/json", "Connect-Protocol-Version": "1"}
        if as_user:
            headers.update(self._user_header())
        try:
            response = await self.http.post(f"/{method}", content=json.dumps(body), headers=headers)
        except httpx.TransportError as exc:
            raise unreachable(self.url, exc) from exc
        if response.status_code != 200:
            raise _error(self.sandbox_id, response, response.content)
        return response.json() if response.content else {}

    async def stream(
        self, method: str, body: dict[str, Any], *, as_user: bool = False, deadline_s: int | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Messages of a server-streaming RPC. envd kills a process at its `deadline_s`; without one it
        lives until it exits."""
        payload = json.dumps(body).encode()
        headers = {
            "Content-Type": "application/connect+json",
            "Connect-Protocol-Version": "1",
            "Keepalive-Ping-Interval": str(KEEPALIVE_S),
        }
        if as_user:
            headers.update(self._user_header())
        if deadline_s:
            headers["Connect-Timeout-Ms"] = str(deadline_s * 1000)
        timeout = httpx.Timeout(READ_TIMEOUT, connect=10.0)
        request = self.http.build_request(
            "POST", f"/{method}", content=envelope(payload),
            headers=headers, timeout=timeout,
        )  # fmt: skip
        try:
            response = await self.http.send(request, stream=True)
        except httpx.TransportError as exc:
            raise unreachable(self.url, exc) from exc
        try:
            if response.status_code != 200:
                raise _error(self.sandbox_id, response, await response.aread())
            async for flags, message in envelopes(response.aiter_bytes()):
                if flags & FLAG_END_STREAM:
                    if error := message.get("error"):
                        raise EnvdError(str(error.get("code")), str(error.get("message")))
                    return
                yield message
            raise EnvdError("unavailable", f"the connection to sandbox {self.sandbox_id} was cut")
        finally:
            await response.aclose()

    # -- process -----------------------------------------------------------------------------

    async def send_input(self, pid: int, data: bytes, *, pty: bool) -> None:
        kind = "pty" if pty else "stdin"
        await self.unary("process.Process/SendInput", {"process": {"pid": pid}, "input": {kind: b64(data)}})

    async def close_stdin(self, pid: int) -> None:
        await self.unary("process.Process/CloseStdin", {"process": {"pid": pid}})

    async def resize(self, pid: int, cols: int, rows: int) -> None:
        body = {"process": {"pid": pid}, "pty": {"size": {"cols": cols, "rows": rows}}}
        await self.unary("process.Process/Update", body)

    async def signal(self, pid: int, name: str) -> None:
        await self.unary("process.Process/SendSignal", {"process": {"pid": pid}, "signal": f"SIGNAL_{name}"})

    # -- filesystem --------------------------------------------------------------------------

    async def stat(self, path: str) -> dict[str, Any] | None:
        """The entry, or None when nothing is at `path`."""
        try:
            reply = await self.unary("filesystem.Filesystem/Stat", {"path": path}, as_user=True)
        except EnvdError as exc:
            if exc.rpc_code == "not_found":
                return None
            raise
        return reply["entry"]

    async def list_dir(self, path: str, depth: int) -> list[dict[str, Any]]:
        body = {"path": path, "depth": depth}
        return (await self.unary("filesystem.Filesystem/ListDir", body, as_user=True)).get("entries", [])

    async def make_dir(self, path: str) -> None:
        try:
            await self.unary("filesystem.Filesystem/MakeDir", {"path": path}, as_user=True)
        except EnvdError as exc:
            if exc.rpc_code != "already_exists":
                raise

    def _file_params(self, path: str) -> dict[str, str]:
        return {"path": path} | ({"username": self.user} if self.user else {})

    async def upload(self, path: str, body: AsyncIterator[bytes], size: int) -> None:
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        try:
            response = await self.http.post(
                "/files", params=self._file_params(path), content=body, headers=headers,
                timeout=httpx.Timeout(READ_TIMEOUT, connect=10.0),
            )  # fmt: skip
        except httpx.TransportError as exc:
            raise unreachable(self.url, exc) from exc
        if response.status_code >= 400:
            raise _error(self.sandbox_id, response, response.content)

    async def download(self, path: str) -> AsyncIterator[bytes]:
        request = self.http.build_request(
            "GET", "/files", params=self._file_params(path), timeout=httpx.Timeout(READ_TIMEOUT, connect=10.0)
        )
        try:
            response = await self.http.send(request, stream=True)
        except httpx.TransportError as exc:
            raise unreachable(self.url, exc) from exc
        try:
            if response.status_code >= 400:
                raise _error(self.sandbox_id, response, await response.aread())
            async for chunk in response.aiter_bytes():
                yield chunk
        finally:
            await response.aclose()


def exit_status(end: dict[str, Any]) -> int:
    """A shell-style status from envd's end event: the exit code, 128+N for a signal, 255 if unknown."""
    status = str(end.get("status", ""))
    if status.startswith("signal: "):
        signals = {"hangup": 1, "interrupt": 2, "quit": 3, "killed": 9, "terminated": 15}
        return 128 + signals.get(status.removeprefix("signal: "), 127)
    code = end.get("exitCode", 0)
    return code if isinstance(code, int) and 0 <= code <= 255 else 255
