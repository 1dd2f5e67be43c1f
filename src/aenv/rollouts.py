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
from e2b import ConnectionConfig, Sandbox
from e2b.exceptions import (
    InvalidArgumentException,
    NotFoundException,
    RateLimitException,
    SandboxException,
)
from packaging.version import Version

__all__ = ["checkpoint", "checkpoints", "delete_checkpoint", "fan_out", "promote", "reset"]

# Errors as the SDK raises them for the same status (anything else is a SandboxException).
EXCEPTIONS: dict[int, type[SandboxException]] = {
    400: InvalidArgumentException,
    404: NotFoundException,
    429: RateLimitException,
}
FAN_OUT_TIMEOUT = 900.0  # seconds: a thousand creates on a busy cluster take minutes


def _error(status: int, message: str) -> SandboxException:
    return EXCEPTIONS.get(status, SandboxException)(f"{status}: {message}")


def _call(
    config: ConnectionConfig, method: str, path: str, timeout: float | None = None, **kwargs: Any
) -> Any:
    """One call to the API; its error answer raised as the SDK's exception for that status."""
    headers = {**config.headers, "X-API-Key": config.api_key or ""}
    seconds = timeout if timeout is not None else config.request_timeout
    response = httpx.request(method, config.api_url + path, headers=headers, timeout=seconds, **kwargs)
    if response.status_code >= 400:
        try:
            message = response.json().get("message", response.text)
        except ValueError:
            message = response.text
        raise _error(response.status_code, message)
    return response.json() if response.content else None


def _sandbox(view: dict[str, Any], opts: dict[str, Any]) -> Sandbox:
    """The SDK's `Sandbox` for a sandbox as create answers it (as `Sandbox.fork` builds them)."""
    headers = {"E2b-Sandbox-Id": view["sandboxID"], "E2b-Sandbox-Port": str(ConnectionConfig.envd_port)}
    if view.get("envdAccessToken"):
        headers["X-Access-Token"] = view["envdAccessToken"]
    return Sandbox(
        sandbox_id=view["sandboxID"],
        sandbox_domain=view.get("domain"),
        envd_version=Version(view["envdVersion"]),
        envd_access_token=view.get("envdAccessToken"),
        traffic_access_token=view.get("trafficAccessToken"),
        connection_config=ConnectionConfig(extra_sandbox_headers=headers, **opts),
    )


def fan_out(
    template: str,
    count: int,
    *,
    timeout: int | None = None,
    metadata: dict[str, str] | None = None,
    envs: dict[str, str] | None = None,
    allow_internet_access: bool | None = None,
    network: dict[str, Any] | None = None,
    volume_mounts: list[dict[str, str]] | None = None,
    idempotency_key: str | None = None,
    **opts: Any,
) -> list[Sandbox | SandboxException]:
    """Start `count` (1-1,000) sandboxes from a template or snapshot in one call.

    One entry per sandbox, in order: its `Sandbox`, or the exception its create would have
    raised (each one succeeds or fails alone, as `Sandbox.fork`'s children). With an
    `idempotency_key`, calling again (after a timeout, say) returns the same sandboxes.
    `network` and `volume_mounts` are the API's spellings (`{"allowOut": [...]}`,
    `[{"name": volume, "path": "/mnt/data"}]`); `opts` are the SDK's (`api_key`, `domain`, ...).
    """
    body: dict[str, Any] = {"templateID": template, "count": count}
    optional = {
        "timeout": timeout, "metadata": metadata, "envVars": envs, "network": network,
        "allow_internet_access": allow_internet_access, "volumeMounts": volume_mounts,
        "idempotencyKey": idempotency_key,
    }  # fmt: skip
    body.update({key: value for key, value in optional.items() if value is not None})
    results = _call(ConnectionConfig(**opts), "POST", "/sandboxes/fanout", FAN_OUT_TIMEOUT, json=body)
    return [
        _sandbox(r["sandbox"], opts) if "sandbox" in r else _error(r["error"]["code"], r["error"]["message"])
        for r in results
    ]


def _checkpoints(sandbox: Sandbox, checkpoint: str = "") -> str:
    path = f"/sandboxes/{sandbox.sandbox_id}/checkpoints"
    return f"{path}/{checkpoint}" if checkpoint else path


def checkpoint(sandbox: Sandbox, name: str | None = None) -> dict[str, Any]:
    """Checkpoint the running sandbox (memory and disk); returns the checkpoint (`checkpointID`,
    `name`, `parent`, `createdAt`, ...). Kept while the sandbox lives."""
    body = {"name": name} if name else {}
    return _call(sandbox.connection_config, "POST", _checkpoints(sandbox), json=body)


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
    return _call(
        sandbox.connection_config, "POST", _checkpoints(sandbox, checkpoint) + "/snapshot", json=body
    )["snapshotID"]


def reset(sandbox: Sandbox, checkpoint: str) -> None:
    """Restore the running sandbox to a checkpoint (id or name): every process, file and memory
    page as they were then, its clock set to now. The `Sandbox` object stays valid: same id,
    URL and token."""
    _call(
        sandbox.connection_config,
        "POST",
        f"/sandboxes/{sandbox.sandbox_id}/reset",
        json={"checkpoint": checkpoint},
    )
