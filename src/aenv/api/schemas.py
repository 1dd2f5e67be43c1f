"""Request bodies of the control plane, validated strictly: unknown fields and wrong types are 400s.

Field names are the E2B wire names (camelCase, except `allow_internet_access`). Every field the
official SDKs send is accepted, including those this node stores without acting on (`mcp`,
`iam`, `volumeMounts`, `autoPauseMemory`), so SDK calls never fail on them.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

StrMap = dict[StrictStr, StrictStr]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


def _check_cidrs(values: list[str] | None, *, what: str) -> list[str] | None:
    for value in values or ():
        try:
            ipaddress.ip_network(value, strict=False)
        except ValueError:
            raise ValueError(
                f"{what} entry {value!r} is not an IP address or CIDR (domain names are not supported)"
            ) from None
    return values


class AutoResume(Body):
    enabled: StrictBool = False


class NetworkConfig(Body):
    allow_out: list[StrictStr] | None = Field(default=None, alias="allowOut")
    deny_out: list[StrictStr] | None = Field(default=None, alias="denyOut")
    allow_public_traffic: StrictBool | None = Field(default=None, alias="allowPublicTraffic")
    mask_request_host: StrictStr | None = Field(default=None, alias="maskRequestHost")
    dns_servers: list[StrictStr] | None = Field(default=None, alias="dnsServers")
    https_ports: list[StrictInt] | None = Field(default=None, alias="httpsPorts")
    egress_proxy: dict[str, Any] | None = Field(default=None, alias="egressProxy")
    rules: dict[str, Any] | None = None

    @field_validator("allow_out")
    @classmethod
    def _allow(cls, values: list[str] | None) -> list[str] | None:
        return _check_cidrs(values, what="allowOut")

    @field_validator("deny_out")
    @classmethod
    def _deny(cls, values: list[str] | None) -> list[str] | None:
        return _check_cidrs(values, what="denyOut")

    def wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class NewSandbox(Body):
    """`POST /v2/sandboxes` and the legacy `POST /sandboxes` (which adds `secure`)."""

    template_id: StrictStr = Field(alias="templateID", min_length=1, max_length=256)
    timeout: StrictInt | None = Field(default=None, ge=0)
    auto_pause: StrictBool | None = Field(default=None, alias="autoPause")
    auto_pause_memory: StrictBool | None = Field(default=None, alias="autoPauseMemory")
    auto_resume: AutoResume | None = Field(default=None, alias="autoResume")
    secure: StrictBool | None = None
    allow_internet_access: StrictBool | None = None
    network: NetworkConfig | None = None
    metadata: StrMap | None = None
    env_vars: StrMap | None = Field(default=None, alias="envVars")
    mcp: dict[str, Any] | None = None
    iam: dict[str, Any] | None = None
    volume_mounts: list[dict[str, Any]] | None = Field(default=None, alias="volumeMounts")


class ConnectSandbox(Body):
    timeout: StrictInt | None = Field(default=None, ge=0)
    memory: StrictBool | None = None


class ResumeSandbox(Body):
    timeout: StrictInt | None = Field(default=None, ge=0)
    auto_pause: StrictBool | None = Field(default=None, alias="autoPause")
    memory: StrictBool | None = None


class TimeoutRequest(Body):
    timeout: StrictInt = Field(ge=0)


class RefreshRequest(Body):
    duration: StrictInt | None = Field(default=None, ge=0, le=3600)


class PauseRequest(Body):
    memory: StrictBool | None = None
    require_healthy_guest: StrictBool | None = Field(default=None, alias="requireHealthyGuest")


class SnapshotRequest(Body):
    name: StrictStr | None = Field(default=None, pattern=r"^[A-Za-z0-9_/:.-]{1,128}$")
    memory: StrictBool | None = None


class ForkRequest(Body):
    timeout: StrictInt | None = Field(default=None, ge=0)
    count: StrictInt = Field(default=1, ge=1)


class NetworkUpdate(NetworkConfig):
    allow_internet_access: StrictBool | None = None
