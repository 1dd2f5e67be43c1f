"""Rollouts from Python with the official E2B SDK: fan-out, checkpoints and reset.

These call aenv's extensions of the API (`aenv.api.rollouts`) with the SDK's own connection
settings (`E2B_API_URL`, `E2B_API_KEY`, or the same keyword arguments the SDK takes), and hand
back the SDK's `Sandbox` objects, built as the SDK builds a fork's children, so everything the
SDK does with a sandbox works on them unchanged.

```python
from aenv import rollouts

group = rollouts.fan_out("base", 8, timeout=600, idempotency_key="step-17")
sandbox = group[0]                       # an e2b.Sandbox (or the exception for that one)
start = rollouts.checkpoint(sandbox, "start")
sandbox.commands.run("rm -rf /tmp/work")
rollouts.reset(sandbox, "start")         # same id, URL and token; every process and file back
```
"""

from __future__ import annotations

from typing import Any

import httpx
from e2b import AsyncSandbox, ConnectionConfig, Sandbox
from e2b.exceptions import (
    InvalidArgumentException,
    NotFoundException,
    RateLimitException,
    SandboxException,
)
from packaging.version import Version

__all__ = [
    "checkpoint",
    "checkpoint_async",
    "checkpoints",
    "delete_checkpoint",
    "fan_out",
    "fan_out_async",
    "promote",
    "reset",
    "reset_async",
]

# Errors as the SDK raises them for the same status (anything else is a SandboxException).
EXCEPTIONS: dict[int, type[SandboxException]] = {
    400: InvalidArgumentException,
    404: NotFoundException,
    429: RateLimitException,
}
FAN_OUT_TIMEOUT = 900.0  # seconds: a thousand creates on a busy cluster take minutes


def _error(status: int, message: str) -> SandboxException:
    return EXCEPTIONS.get(status, SandboxException)(f"{status}: {message}")


def _request(
    config: ConnectionConfig, method: str, path: str, timeout: float | None, **kwargs: Any
) -> httpx.Request:
    headers = {**config.headers, "X-API-Key": config.api_key or ""}
    seconds = timeout if timeout is not None else config.request_timeout
    extensions = {"timeout": httpx.Timeout(seconds).as_dict()}
    return httpx.Request(method, config.api_url + path, headers=headers, extensions=extensions, **kwargs)


def _answer(response: httpx.Response) -> Any:
    """The answer's JSON; an error answer raised as the SDK's exception for that status."""
    if response.status_code >= 400:
        try:
            message = response.json().get("message", response.text)
        except ValueError:
            message = response.text
        raise _error(response.status_code, message)
    return response.json() if response.content else None


def _call(
    config: ConnectionConfig, method: str, path: str, timeout: float | None = None, **kwargs: Any
) -> Any:
    with httpx.Client() as client:
        return _answer(client.send(_request(config, method, path, timeout, **kwargs)))


async def _call_async(
    config: ConnectionConfig, method: str, path: str, timeout: float | None = None, **kwargs: Any
) -> Any:
    async with httpx.AsyncClient() as client:
        return _answer(await client.send(_request(config, method, path, timeout, **kwargs)))


def _sandbox(view: dict[str, Any], opts: dict[str, Any], kind: type[Any]) -> Any:
    """The SDK's `Sandbox` (or `AsyncSandbox`) for a sandbox as create answers it, built as
    `Sandbox.fork` builds its children."""
    headers = {"E2b-Sandbox-Id": view["sandboxID"], "E2b-Sandbox-Port": str(ConnectionConfig.envd_port)}
    if view.get("envdAccessToken"):
        headers["X-Access-Token"] = view["envdAccessToken"]
    return kind(
        sandbox_id=view["sandboxID"],
        sandbox_domain=view.get("domain"),
        envd_version=Version(view["envdVersion"]),
        envd_access_token=view.get("envdAccessToken"),
        traffic_access_token=view.get("trafficAccessToken"),
        connection_config=ConnectionConfig(extra_sandbox_headers=headers, **opts),
    )


# `fan_out`'s create options and their names on the wire.
CREATE_OPTIONS = {
    "timeout": "timeout", "metadata": "metadata", "envs": "envVars", "network": "network",
    "allow_internet_access": "allow_internet_access", "volume_mounts": "volumeMounts",
    "idempotency_key": "idempotencyKey",
}  # fmt: skip


def _fan_out(template: str, count: int, options: dict[str, Any]) -> tuple[ConnectionConfig, dict[str, Any]]:
    """The connection (from the SDK's options among `options`) and the body of a fan-out."""
    body: dict[str, Any] = {"templateID": template, "count": count}
    body.update({CREATE_OPTIONS[k]: v for k, v in options.items() if k in CREATE_OPTIONS and v is not None})
    return ConnectionConfig(**_sdk_options(options)), body


def _sdk_options(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k not in CREATE_OPTIONS}


def _fanned_out(results: list[dict[str, Any]], options: dict[str, Any], kind: type[Any]) -> list[Any]:
    opts = _sdk_options(options)
    return [
        _sandbox(r["sandbox"], opts, kind)
        if "sandbox" in r
        else _error(r["error"]["code"], r["error"]["message"])
        for r in results
    ]


def fan_out(template: str, count: int, **options: Any) -> list[Sandbox | SandboxException]:
    """Start `count` (1-1,000) sandboxes from a template or snapshot in one call.

    One entry per sandbox, in order: its `Sandbox`, or the exception its create would have
    raised (each one succeeds or fails alone, as `Sandbox.fork`'s children). The create options
    are `timeout`, `metadata`, `envs`, `allow_internet_access`, `network` and `volume_mounts`
    (the last two in the API's spelling: `{"allowOut": [...]}`, `[{"name": volume, "path":
    "/mnt/data"}]`); with an `idempotency_key`, calling again (after a timeout, say) returns the
    same sandboxes. Other keyword arguments are the SDK's (`api_key`, `domain`, `api_url`, ...).
    """
    config, body = _fan_out(template, count, options)
    results = _call(config, "POST", "/sandboxes/fanout", FAN_OUT_TIMEOUT, json=body)
    return _fanned_out(results, options, Sandbox)


async def fan_out_async(template: str, count: int, **options: Any) -> list[AsyncSandbox | SandboxException]:
    """`fan_out` for asyncio code: the same options, `AsyncSandbox` objects."""
    config, body = _fan_out(template, count, options)
    results = await _call_async(config, "POST", "/sandboxes/fanout", FAN_OUT_TIMEOUT, json=body)
    return _fanned_out(results, options, AsyncSandbox)


def _checkpoints(sandbox: Sandbox | AsyncSandbox, checkpoint: str = "") -> str:
    path = f"/sandboxes/{sandbox.sandbox_id}/checkpoints"
    return f"{path}/{checkpoint}" if checkpoint else path


def checkpoint(sandbox: Sandbox, name: str | None = None) -> dict[str, Any]:
    """Checkpoint the running sandbox (memory and disk); returns the checkpoint (`checkpointID`,
    `name`, `parent`, `createdAt`, ...). Kept while the sandbox lives."""
    body = {"name": name} if name else {}
    return _call(sandbox.connection_config, "POST", _checkpoints(sandbox), json=body)


async def checkpoint_async(sandbox: AsyncSandbox, name: str | None = None) -> dict[str, Any]:
    """`checkpoint` for asyncio code."""
    body = {"name": name} if name else {}
    return await _call_async(sandbox.connection_config, "POST", _checkpoints(sandbox), json=body)


def checkpoints(sandbox: Sandbox) -> list[dict[str, Any]]:
    """The sandbox's checkpoints, oldest first."""
    return _call(sandbox.connection_config, "GET", _checkpoints(sandbox))


def delete_checkpoint(sandbox: Sandbox, checkpoint: str) -> None:
    """Delete a checkpoint by id or name."""
    _call(sandbox.connection_config, "DELETE", _checkpoints(sandbox, checkpoint))


def promote(sandbox: Sandbox, checkpoint: str, name: str | None = None) -> str:
    """Make a snapshot of a checkpoint (id or name); returns its id, which `Sandbox.create` and
    `fan_out` take (as `name`, if given)."""
    body = {"name": name} if name else {}
    path = _checkpoints(sandbox, checkpoint) + "/snapshot"
    return _call(sandbox.connection_config, "POST", path, json=body)["snapshotID"]


def reset(sandbox: Sandbox, checkpoint: str) -> None:
    """Restore the running sandbox to a checkpoint (id or name): every process, file and memory
    page as they were then, its clock set to now. The `Sandbox` object stays valid: same id,
    URL and token."""
    path = f"/sandboxes/{sandbox.sandbox_id}/reset"
    _call(sandbox.connection_config, "POST", path, json={"checkpoint": checkpoint})


async def reset_async(sandbox: AsyncSandbox, checkpoint: str) -> None:
    """`reset` for asyncio code."""
    path = f"/sandboxes/{sandbox.sandbox_id}/reset"
    await _call_async(sandbox.connection_config, "POST", path, json={"checkpoint": checkpoint})
