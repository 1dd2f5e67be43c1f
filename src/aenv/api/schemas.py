"""Request bodies of the control plane, validated strictly: unknown fields and wrong types are 400s.

Field names are the E2B wire names (camelCase, except `allow_internet_access`). Every field the
official SDKs send is accepted, including those this node stores without acting on (`mcp`,
`iam`), so SDK calls never fail on them.

Every constraint is checked here and declared in the models' JSON schemas, so the OpenAPI
document states what the node accepts. Bounds that are node settings (`max_timeout`,
`max_fork_count`) come from the validation context (`limits`), and the OpenAPI document fills
them in where the schemas carry the `LIMIT_KEY` marker.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)

from ..config import Settings
from ..volumes.store import MIN_VOLUME_MIB, NAME_PATTERN
from ..wiretypes import INTEGRAL, Int

StrMap = dict[StrictStr, StrictStr]

# JSON-schema marker naming the setting whose value is the field's `maximum` (see openapi.py).
LIMIT_KEY = "x-aenv-maximum-setting"
LIMITED_SETTINGS = ("max_timeout", "max_fork_count", "volume_max_mib")


def limits(settings: Settings) -> dict[str, int]:
    """The validation context of a node with these settings: its values of the limited settings."""
    return {name: getattr(settings, name) for name in LIMITED_SETTINGS}


def _at_most(setting: str, unit: str) -> AfterValidator:
    def check(value: int, info: ValidationInfo) -> int:
        limit = (info.context or {}).get(setting, getattr(Settings, setting))
        if value > limit:
            raise ValueError(f"must be at most {limit}{unit} (this node's {setting})")
        return value

    return AfterValidator(check)


Timeout = Annotated[
    StrictInt,
    Field(ge=0, description="seconds", json_schema_extra={LIMIT_KEY: "max_timeout"}),
    INTEGRAL,
    _at_most("max_timeout", " seconds"),
]
ForkCount = Annotated[
    StrictInt,
    Field(ge=1, json_schema_extra={LIMIT_KEY: "max_fork_count"}),
    INTEGRAL,
    _at_most("max_fork_count", ""),
]
VolumeSize = Annotated[
    StrictInt,
    Field(ge=MIN_VOLUME_MIB, description="MiB", json_schema_extra={LIMIT_KEY: "volume_max_mib"}),
    INTEGRAL,
    _at_most("volume_max_mib", " MiB"),
]
RefreshDuration = Annotated[StrictInt, Field(ge=0, le=3600, description="seconds"), INTEGRAL]


# Pauses and snapshots: false keeps only the disk, and the sandbox boots from it afresh.
# Resumes: false ignores any memory the pause kept.
Memory = Annotated[StrictBool, Field(description="false: the disk only; the sandbox boots from it afresh")]

# IPs and CIDRs, IPv4 or IPv6; domain names are not supported. The pattern declares what the
# validator (Python's ipaddress) takes, in the forms clients write.
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = rf"{_OCTET}(\.{_OCTET}){{3}}(/(3[0-2]|[12]?[0-9]))?"
_HEXTET = "[0-9A-Fa-f]{1,4}"
_IPV6_FORMS = [
    rf"({_HEXTET}:){{7}}{_HEXTET}",
    rf"({_HEXTET}:){{1,7}}:",
    *(rf"({_HEXTET}:){{1,{7 - n}}}(:{_HEXTET}){{1,{n}}}" for n in range(1, 7)),
    rf":((:{_HEXTET}){{1,7}}|:)",
]
_IPV6 = f"({'|'.join(_IPV6_FORMS)})(/(12[0-8]|1[01][0-9]|[1-9]?[0-9]))?"
IP_OR_CIDR_PATTERN = f"^({_IPV4}|{_IPV6})$"
IpOrCidr = Annotated[
    StrictStr,
    Field(json_schema_extra={"pattern": IP_OR_CIDR_PATTERN, "description": "an IP address or CIDR"}),
]

# E2B's `namespace/name:tag` spelling of a snapshot name, lowercase. The node keeps `name` (it has
# no namespaces, and every snapshot has the one tag `default`); `name` follows the repository's
# alias rules.
_NAME_PART = r"[a-z0-9][a-z0-9._-]{0,62}"
SNAPSHOT_NAME_PATTERN = rf"^({_NAME_PART}/)?{_NAME_PART}(:{_NAME_PART})?$"


def _snapshot_name(value: str) -> str:
    if not re.fullmatch(SNAPSHOT_NAME_PATTERN, value):
        raise ValueError(
            f"invalid snapshot name {value!r}: use 1-63 lowercase letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, optionally as namespace/name:tag"
        )
    return value


SnapshotName = Annotated[
    StrictStr,
    AfterValidator(_snapshot_name),
    WithJsonSchema({"type": "string", "pattern": SNAPSHOT_NAME_PATTERN, "maxLength": 128}),
]


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
    allow_out: list[IpOrCidr] | None = Field(default=None, alias="allowOut")
    deny_out: list[IpOrCidr] | None = Field(default=None, alias="denyOut")
    allow_public_traffic: StrictBool | None = Field(default=None, alias="allowPublicTraffic")
    mask_request_host: StrictStr | None = Field(default=None, alias="maskRequestHost")
    dns_servers: list[StrictStr] | None = Field(default=None, alias="dnsServers")
    https_ports: list[Int] | None = Field(default=None, alias="httpsPorts")
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


# E2B's rule for a filesystem-only auto-pause (`autoPauseMemory: false`): it needs `autoPause` and
# excludes `autoResume`. Declared in the schema so that clients (and the fuzzer) can know it.
FILESYSTEM_PAUSE_RULE = {
    "if": {"properties": {"autoPauseMemory": {"const": False}}, "required": ["autoPauseMemory"]},
    "then": {
        "properties": {
            "autoPause": {"const": True},
            "autoResume": {
                "anyOf": [{"type": "null"}, {"properties": {"enabled": {"const": False}}}],
            },
        },
        "required": ["autoPause"],
    },
}


VOLUME_NAME = NAME_PATTERN


# An absolute path other than `/` whose components are portable names (letters, digits and
# `._@%+=:,~-`, not starting with `..`).
MOUNT_PATH = r"^(/\.?[A-Za-z0-9_@%+=:,~-][A-Za-z0-9._@%+=:,~-]*)+/?$"


class VolumeMount(Body):
    """A volume (by name) and where the sandbox sees it."""

    name: StrictStr = Field(pattern=VOLUME_NAME)
    path: Annotated[
        StrictStr, Field(max_length=1024, pattern=MOUNT_PATH), AfterValidator(lambda p: p.rstrip("/"))
    ]


class NewVolume(Body):
    """`POST /volumes`; `sizeMiB` is aenv's (E2B's create has no size): the volume's size, the
    node's `volume_max_mib` when not given."""

    name: StrictStr = Field(pattern=VOLUME_NAME)
    size_mib: VolumeSize | None = Field(default=None, alias="sizeMiB")


class VolumeMetadata(Body):
    """`PATCH /volumecontent/{volumeID}/path`: owner and mode to set (unset ones are kept)."""

    uid: Annotated[StrictInt, Field(ge=0, le=2**32 - 1)] | None = None
    gid: Annotated[StrictInt, Field(ge=0, le=2**32 - 1)] | None = None
    mode: Annotated[StrictInt, Field(ge=0, le=0o7777)] | None = None


class NewSandbox(Body):
    """`POST /v2/sandboxes`: every v2 sandbox is secured, so it has no `secure` field."""

    model_config = ConfigDict(json_schema_extra=FILESYSTEM_PAUSE_RULE)

    template_id: StrictStr = Field(alias="templateID", min_length=1, max_length=256)
    timeout: Timeout | None = None
    auto_pause: StrictBool | None = Field(default=None, alias="autoPause")
    auto_pause_memory: StrictBool | None = Field(default=None, alias="autoPauseMemory")
    auto_resume: AutoResume | None = Field(default=None, alias="autoResume")
    allow_internet_access: StrictBool | None = None
    network: NetworkConfig | None = None
    metadata: StrMap | None = None
    env_vars: StrMap | None = Field(default=None, alias="envVars")
    mcp: dict[str, Any] | None = None
    iam: dict[str, Any] | None = None
    volume_mounts: Annotated[list[VolumeMount] | None, Field(max_length=16)] = Field(
        default=None, alias="volumeMounts"
    )


class NewSandboxV1(NewSandbox):
    """The legacy `POST /sandboxes`, where `secure: false` makes envd take no access token."""

    secure: StrictBool | None = None


class ConnectSandbox(Body):
    timeout: Timeout | None = None
    memory: Memory | None = None


class ResumeSandbox(Body):
    timeout: Timeout | None = None
    auto_pause: StrictBool | None = Field(default=None, alias="autoPause")
    memory: Memory | None = None


class TakeOver(Body):
    timeout: Timeout | None = None


class TimeoutRequest(Body):
    timeout: Timeout


class RefreshRequest(Body):
    duration: RefreshDuration | None = None


class PauseRequest(Body):
    memory: Memory | None = None
    require_healthy_guest: StrictBool | None = Field(default=None, alias="requireHealthyGuest")


class SnapshotRequest(Body):
    name: SnapshotName | None = None
    memory: Memory | None = None


class ForkRequest(Body):
    timeout: Timeout | None = None
    count: ForkCount = 1


class FanOut(NewSandbox):
    """`POST /sandboxes/fanout` (aenv): `count` sandboxes with a create's options, each succeeding
    or failing alone; with an `idempotencyKey`, a retried call returns the same sandboxes."""

    count: Annotated[StrictInt, Field(ge=1, le=1000), INTEGRAL]
    idempotency_key: StrictStr | None = Field(
        default=None, alias="idempotencyKey", min_length=1, max_length=128, pattern=r"^[\x21-\x7e]+$"
    )


class CheckpointRequest(Body):
    """`POST /sandboxes/{sandboxID}/checkpoints` (aenv); without a name, the checkpoint has its id only."""

    name: StrictStr | None = Field(default=None, min_length=1, max_length=64)


class CheckpointSnapshotRequest(Body):
    """`POST /sandboxes/{sandboxID}/checkpoints/{checkpointID}/snapshot` (aenv): a snapshot's
    name; a checkpoint always keeps memory, so there is no `memory` to choose."""

    name: SnapshotName | None = None


class ResetRequest(Body):
    """`POST /sandboxes/{sandboxID}/reset` (aenv): the checkpoint's id or name."""

    checkpoint: StrictStr = Field(min_length=1, max_length=64)


class NetworkUpdate(NetworkConfig):
    allow_internet_access: StrictBool | None = None
