"""What a committed snapshot is: the machine it needs, the blobs it is made of, how to run it.

A manifest is plain JSON with stable key names and a ``format_version``. A node refuses a
manifest written in a newer format rather than guessing at fields it does not know; keys it
does not know inside a known version are ignored, so additions that older readers may
safely skip need no version bump. Blobs are named by ``sha256:<hex>`` digests of their bytes.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, Literal

from ..clock import rfc3339
from .names import DIGEST_RE, LAYER_ID_RE, SNAPSHOT_ID_RE

FORMAT_VERSION = 1

_BASE36 = "0123456789abcdefghijklmnopqrstuvwxyz"
_TIME_CHARS = 9  # 36**9 ms reaches the year 5138, so ids sort by creation time as plain strings
_RANDOM_CHARS = 11

Kind = Literal["template", "snapshot"]
Accel = Literal["kvm", "tcg"]


class ManifestError(ValueError):
    """A manifest (or one of its parts) is malformed or written in a format this node cannot read."""


class SnapshotMismatch(ValueError):
    """A snapshot cannot be restored on this node: the machine it was taken on differs."""


def _base36(value: int, width: int) -> str:
    digits = []
    for _ in range(width):
        value, rest = divmod(value, 36)
        digits.append(_BASE36[rest])
    return "".join(reversed(digits))


def new_snapshot_id() -> str:
    """A 20-character lowercase id: milliseconds since the epoch, then randomness (ids sort by time)."""
    random = int.from_bytes(os.urandom(8)) % 36**_RANDOM_CHARS
    return _base36(time.time_ns() // 1_000_000, _TIME_CHARS) + _base36(random, _RANDOM_CHARS)


def utc_now() -> str:
    """Current time as manifests record it (RFC 3339 UTC, milliseconds)."""
    return rfc3339()


def parse_timestamp(value: str) -> datetime:
    """Parse an RFC 3339 timestamp that carries an explicit offset."""
    try:
        parsed = datetime.fromisoformat(value)
    except (TypeError, ValueError) as exc:
        raise ManifestError(f"created_at {value!r} is not an RFC 3339 timestamp") from exc
    if parsed.tzinfo is None:
        raise ManifestError(f"created_at {value!r} has no UTC offset")
    return parsed


def check_digest(value: object, what: str) -> str:
    """Return ``value`` if it is a ``sha256:<64 hex>`` digest, else raise naming ``what``."""
    if not isinstance(value, str) or not DIGEST_RE.fullmatch(value):
        raise ManifestError(f"{what} must be a digest 'sha256:<64 lowercase hex>', got {value!r}")
    return value


def _require(data: Any, cls: type) -> dict[str, Any]:
    """The keys of ``cls``'s fields taken from ``data``; a missing key is an error naming it."""
    if not isinstance(data, dict):
        raise ManifestError(f"{cls.__name__} must be a JSON object, got {type(data).__name__}")
    missing = [f.name for f in fields(cls) if f.name not in data]
    if missing:
        raise ManifestError(f"{cls.__name__} is missing {', '.join(missing)}")
    return {f.name: data[f.name] for f in fields(cls)}


def _check_types(obj: object, expected: dict[str, type | tuple[type, ...]]) -> None:
    for name, types in expected.items():
        value = getattr(obj, name)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
            raise ManifestError(f"{type(obj).__name__}.{name} has the wrong type: {value!r}")


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _check_str_map(value: object, what: str) -> None:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ManifestError(f"{what} must map strings to strings")


def _show(value: object) -> str:
    """A field value for an error message: quoted only when it would read ambiguously."""
    ambiguous = isinstance(value, str) and (not value or any(c.isspace() for c in value))
    return repr(value) if ambiguous else str(value)


@dataclass(frozen=True)
class MachineShape:
    """Everything about the VM that must be identical for a snapshot to restore correctly."""

    qemu_version: str
    machine_type: str
    vcpus: int
    memory_mib: int
    accel: Accel
    kernel_digest: str
    initramfs_digest: str
    tools_digest: str
    cmdline: str

    def __post_init__(self) -> None:
        _check_types(
            self,
            {
                "qemu_version": str,
                "machine_type": str,
                "vcpus": int,
                "memory_mib": int,
                "accel": str,
                "kernel_digest": str,
                "initramfs_digest": str,
                "tools_digest": str,
                "cmdline": str,
            },
        )
        if self.accel not in ("kvm", "tcg"):
            raise ManifestError(f"accel must be 'kvm' or 'tcg', got {self.accel!r}")
        if self.vcpus < 1 or self.memory_mib < 1:
            raise ManifestError(f"vcpus and memory_mib must be positive, got {self.vcpus}, {self.memory_mib}")

    def check_compatible(self, other: MachineShape) -> None:
        """Raise ``SnapshotMismatch`` naming every field where ``other`` (this node) differs from ``self``."""
        differ = [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]
        if differ:
            taken = ", ".join(f"{name}={_show(getattr(self, name))}" for name in differ)
            runs = ", ".join(f"{name}={_show(getattr(other, name))}" for name in differ)
            raise SnapshotMismatch(f"snapshot was taken with {taken} but this node runs {runs}")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Any) -> MachineShape:
        return cls(**_require(data, cls))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> MachineShape:
        return cls.from_dict(_loads(text))


@dataclass(frozen=True)
class RuntimeContext:
    """How processes run in the restored guest: environment, directory, user, start/ready commands."""

    env_vars: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    start_cmd: str | None = None
    ready_cmd: str | None = None

    def __post_init__(self) -> None:
        _check_str_map(self.env_vars, "RuntimeContext.env_vars")
        optional = ("workdir", "user", "start_cmd", "ready_cmd")
        _check_types(self, {name: (str, type(None)) for name in optional})

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Any) -> RuntimeContext:
        return cls(**_require(data, cls))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RuntimeContext:
        return cls.from_dict(_loads(text))


@dataclass(frozen=True)
class SnapshotManifest:
    """A committed snapshot or template: immutable once written to the repository."""

    id: str
    kind: Kind
    alias: str | None
    created_at: str
    source: dict[str, str]
    machine: MachineShape
    memory_image: str
    memory_deltas: tuple[str, ...]
    device_state: str
    vmstate_prefix: str
    disk_layers: tuple[str, ...]
    runtime: RuntimeContext = field(default_factory=RuntimeContext)
    metadata: dict[str, str] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not SNAPSHOT_ID_RE.fullmatch(self.id):
            raise ManifestError(f"snapshot id must be 1-64 characters of [a-z0-9], got {self.id!r}")
        if self.kind not in ("template", "snapshot"):
            raise ManifestError(f"kind must be 'template' or 'snapshot', got {self.kind!r}")
        _check_types(
            self,
            {
                "alias": (str, type(None)),
                "created_at": str,
                "machine": MachineShape,
                "runtime": RuntimeContext,
                "memory_deltas": tuple,
                "disk_layers": tuple,
            },
        )
        parse_timestamp(self.created_at)
        _check_str_map(self.source, "source")
        _check_str_map(self.metadata, "metadata")
        if not isinstance(self.sizes, dict) or not all(
            isinstance(k, str) and type(v) is int for k, v in self.sizes.items()
        ):
            raise ManifestError("sizes must map digests to byte counts")
        check_digest(self.memory_image, "memory_image")
        check_digest(self.device_state, "device_state")
        check_digest(self.vmstate_prefix, "vmstate_prefix")
        for i, digest in enumerate(self.memory_deltas):
            check_digest(digest, f"memory_deltas[{i}]")
        for i, layer in enumerate(self.disk_layers):
            if not isinstance(layer, str) or not (DIGEST_RE.fullmatch(layer) or LAYER_ID_RE.fullmatch(layer)):
                raise ManifestError(
                    f"disk_layers[{i}] must be a digest or a [a-z0-9] layer id, got {layer!r}"
                )

    def blobs(self) -> list[str]:
        """Every repository blob this snapshot needs, without repeats, in a stable order.

        Disk layers and the machine's kernel/initramfs/tools digests count only when they are
        repository digests (``sha256:<hex>``); other values there name things kept outside the
        repository (qcow2 layers in the layer store, build-cache artifacts), which the
        repository neither verifies nor collects.
        """
        shape = self.machine
        maybe = (*self.disk_layers, shape.kernel_digest, shape.initramfs_digest, shape.tools_digest)
        ordered = [
            self.memory_image,
            *self.memory_deltas,
            self.device_state,
            self.vmstate_prefix,
            *(d for d in maybe if DIGEST_RE.fullmatch(d)),
        ]
        return list(dict.fromkeys(ordered))

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "id": self.id,
            "kind": self.kind,
            "alias": self.alias,
            "created_at": self.created_at,
            "source": dict(self.source),
            "machine": self.machine.to_dict(),
            "memory_image": self.memory_image,
            "memory_deltas": list(self.memory_deltas),
            "device_state": self.device_state,
            "vmstate_prefix": self.vmstate_prefix,
            "disk_layers": list(self.disk_layers),
            "runtime": self.runtime.to_dict(),
            "metadata": dict(self.metadata),
            "sizes": dict(self.sizes),
        }

    @classmethod
    def from_dict(cls, data: Any) -> SnapshotManifest:
        if not isinstance(data, dict):
            raise ManifestError(f"a manifest must be a JSON object, got {type(data).__name__}")
        version = data.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise ManifestError(f"manifest has no valid format_version (got {version!r})")
        if version > FORMAT_VERSION:
            raise ManifestError(
                f"manifest format_version {version} is newer than this aenv understands "
                f"(up to {FORMAT_VERSION}); upgrade aenv on this node to use snapshot {data.get('id')!r}"
            )
        if version < 1:
            raise ManifestError(f"manifest format_version {version} is not valid")
        values = _require(data, cls)
        for name in ("memory_deltas", "disk_layers"):
            if not isinstance(values[name], list):
                raise ManifestError(f"{name} must be a list of digests")
            values[name] = tuple(values[name])
        values["machine"] = MachineShape.from_dict(values["machine"])
        values["runtime"] = RuntimeContext.from_dict(values["runtime"])
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> SnapshotManifest:
        return cls.from_dict(_loads(text))


def _loads(text: str | bytes) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"not valid JSON: {exc}") from exc
