"""The node's control plane and a guest's envd as the harness calls them: plain HTTP, timed by the caller.

Every call checks the status the API documents for success and raises with the node's error body
otherwise, so a figure never silently times a failure. The client is aiohttp's: the figures time
the node, and the harness's own cost per request should stay small beside it. Measured against one
node on loopback (median of 200, GET `/health` and `/sandboxes/{id}`): the node answers a kept-alive
raw socket in 0.2-0.35 ms; aiohttp's client adds 0.05-0.2 ms to that, httpx's 1.0-1.2 ms.

Guest commands go through the node's proxy (the `E2b-Sandbox-Id`/`E2b-Sandbox-Port` headers, as
the SDK sends them) with envd's Connect JSON protocol, so the harness needs nothing on the node's
host to prepare a guest.
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import aiohttp
from multidict import CIMultiDict

from aenv.agent.envd import ENVD_PORT
from aenv.agent.envd.framing import ENVELOPE_HEADER, FLAG_END_STREAM, envelope, envelope_header

from .node import DEFAULT_TIMEOUT, BenchError, Node

HEALTH_TIMEOUT = aiohttp.ClientTimeout(total=30.0)


class NodeClient:
    """One HTTP session for the API and the proxy; sandboxes are the JSON the API returns."""

    def __init__(self, node: Node, *, max_connections: int = 64, headers: dict[str, str] | None = None):
        self.node = node
        self._http = aiohttp.ClientSession(
            node.url, headers={"X-API-Key": node.api_key, **(headers or {})},
            connector=aiohttp.TCPConnector(limit=max_connections),
            timeout=aiohttp.ClientTimeout(total=600.0, connect=30.0),
        )  # fmt: skip

    async def aclose(self) -> None:
        await self._http.close()

    async def request(self, method: str, path: str, **options: Any) -> tuple[int, CIMultiDict[str], bytes]:
        """Status, headers and body of one request (`options` as aiohttp's `request` takes them)."""
        async with self._http.request(method, path, **options) as response:
            return response.status, response.headers.copy(), await response.read()

    async def _call(self, method: str, path: str, expect: int | tuple[int, ...], body: Any = None) -> Any:
        status, _, content = await self.request(method, path, json=body)
        if status not in (expect if isinstance(expect, tuple) else (expect,)):
            message = f"{method} {path} answered {status}: {content[:400].decode(errors='replace')}"
            raise BenchError(message, status)
        return json.loads(content) if content else None

    async def create(self, template: str = "base") -> dict[str, Any]:
        """A secured sandbox, as E2B's SDKs create them (v2 has no other kind): envd takes its
        access token, which `run` sends."""
        body = {"templateID": template, "timeout": DEFAULT_TIMEOUT, "secure": True}
        return await self._call("POST", "/sandboxes", 201, body)

    async def pause(self, sandbox_id: str) -> None:
        await self._call("POST", f"/sandboxes/{sandbox_id}/pause", 204)

    async def resume(self, sandbox_id: str) -> dict[str, Any]:
        """`connect` of a paused sandbox resumes it (201) and answers once envd has taken its `/init`."""
        return await self._call("POST", f"/sandboxes/{sandbox_id}/connect", 201, {"timeout": DEFAULT_TIMEOUT})

    async def kill(self, sandbox_id: str, *, missing_ok: bool = False) -> None:
        await self._call("DELETE", f"/sandboxes/{sandbox_id}", (204, 404) if missing_ok else 204)

    async def detail(self, sandbox_id: str) -> dict[str, Any]:
        return await self._call("GET", f"/sandboxes/{sandbox_id}", 200)

    async def snapshot(self, sandbox_id: str) -> dict[str, Any]:
        return await self._call("POST", f"/sandboxes/{sandbox_id}/snapshots", 201, {})

    async def snapshot_info(self, snapshot_id: str) -> dict[str, Any]:
        return await self._call("GET", f"/snapshots/{snapshot_id}", 200)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self._call("DELETE", f"/templates/{snapshot_id}", 204)

    async def fork(self, sandbox_id: str, count: int) -> list[dict[str, Any]]:
        body = {"count": count, "timeout": DEFAULT_TIMEOUT}
        return [
            child["sandbox"] for child in await self._call("POST", f"/sandboxes/{sandbox_id}/fork", 201, body)
        ]

    async def fan_out(self, template: str, count: int, key: str) -> list[dict[str, Any]]:
        """aenv's fan-out: one entry per sandbox, `{"sandbox": ...}` or `{"error": ...}`."""
        body = {"templateID": template, "count": count, "timeout": DEFAULT_TIMEOUT, "idempotencyKey": key}
        return await self._call("POST", "/sandboxes/fanout", 201, body)

    async def checkpoint(self, sandbox_id: str, name: str) -> dict[str, Any]:
        return await self._call("POST", f"/sandboxes/{sandbox_id}/checkpoints", 201, {"name": name})

    async def reset(self, sandbox_id: str, checkpoint: str) -> dict[str, Any]:
        return await self._call("POST", f"/sandboxes/{sandbox_id}/reset", 200, {"checkpoint": checkpoint})

    async def template(self, reference: str) -> dict[str, Any]:
        return await self._call("GET", f"/templates/{reference}", 200)

    async def build_template(self, name: str, start: dict[str, Any], *, poll: float = 0.5) -> None:
        """Build template `name` from a build document (E2B's ``TemplateBuildStartV2``) and wait
        until it is ready, as the SDK's ``Template.build`` does."""
        ticket = await self._call("POST", "/v3/templates", 202, {"name": name})
        build = f"/templates/{ticket['templateID']}/builds/{ticket['buildID']}"
        await self._call("POST", f"/v2{build}", 202, start)
        while (status := await self._call("GET", f"{build}/status?limit=0", 200))["status"] != "ready":
            if status["status"] == "error":
                raise BenchError(f"build of {name} failed: {status.get('reason')}")
            await asyncio.sleep(poll)

    async def delete_template(self, name: str) -> None:
        await self._call("DELETE", f"/templates/{name}", (204, 404))

    async def envd_healthy(self, sandbox_id: str) -> bool:
        """envd's `/health` through the node's proxy."""
        headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(ENVD_PORT)}
        try:
            status, _, _ = await self.request("GET", "/health", headers=headers, timeout=HEALTH_TIMEOUT)
        except (aiohttp.ClientError, TimeoutError):
            return False
        return status == 204

    async def run(self, sandbox: dict[str, Any], command: str, *, timeout: float = 600.0) -> str:
        """Run `command` with bash as root through the proxy; its stdout. Fails on a non-zero exit."""
        process = {"cmd": "/bin/bash", "args": ["-c", command], "envs": {}}
        payload = json.dumps({"process": process}).encode()
        headers = {
            "E2b-Sandbox-Id": sandbox["sandboxID"],
            "E2b-Sandbox-Port": str(ENVD_PORT),
            "Content-Type": "application/connect+json",
            "Connect-Protocol-Version": "1",
            "Connect-Timeout-Ms": str(int(timeout * 1000)),
            "Authorization": "Basic cm9vdDo=",  # user "root", no password
        }
        if sandbox.get("envdAccessToken"):
            headers["X-Access-Token"] = sandbox["envdAccessToken"]
        body = envelope(payload)
        limit = aiohttp.ClientTimeout(total=timeout)
        status, _, content = await self.request(
            "POST", "/process.Process/Start", data=body, headers=headers, timeout=limit
        )
        if status != 200:
            raise BenchError(f"envd Start answered {status}: {content[:400].decode(errors='replace')}")
        return _command_output(command, content)


def _command_output(command: str, stream: bytes) -> str:
    """stdout of a finished Start stream (5-byte framed Connect envelopes); raises on failure."""
    stdout, stderr = bytearray(), bytearray()
    position = 0
    while position + ENVELOPE_HEADER <= len(stream):
        flags, size = envelope_header(stream[position : position + ENVELOPE_HEADER])
        start = position + ENVELOPE_HEADER
        if start + size > len(stream):
            break  # cut short
        frame = json.loads(stream[start : start + size] or b"{}")
        position = start + size
        if flags & FLAG_END_STREAM:
            if "error" in frame:
                raise BenchError(f"{command!r} failed in the guest: {frame['error']}")
            break
        event = frame.get("event", {})
        data = event.get("data", {})
        stdout += _b64(data.get("stdout", ""))
        stderr += _b64(data.get("stderr", ""))
        if "end" in event:
            end = event["end"]
            if end.get("exitCode", 0) != 0 or not end.get("exited", True):
                raise BenchError(
                    f"{command!r} failed in the guest ({end}): {stderr.decode(errors='replace')}"
                )
            return stdout.decode(errors="replace")
    raise BenchError(f"{command!r}: envd's stream ended without an end event")


def _b64(text: str) -> bytes:
    return base64.b64decode(text + "=" * (-len(text) % 4)) if text else b""
