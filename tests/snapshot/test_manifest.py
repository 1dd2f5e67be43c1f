"""Snapshot manifest: JSON round trip, format versions, validation, machine compatibility."""

import dataclasses
import json
import re
import time

import pytest

from aenv.repository.manifest import (
    FORMAT_VERSION,
    MachineShape,
    ManifestError,
    RuntimeContext,
    SnapshotManifest,
    SnapshotMismatch,
    new_snapshot_id,
    parse_timestamp,
    utc_now,
)


def digest(n: int) -> str:
    return "sha256:" + f"{n:x}".rjust(64, "0")


def shape(**changes) -> MachineShape:
    base = MachineShape(
        qemu_version="10.0.2", machine_type="microvm", vcpus=2, memory_mib=512, accel="tcg",
        kernel_digest=digest(100), initramfs_digest=digest(101), tools_digest="abc123",
        cmdline="console=ttyS0 quiet",
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def manifest(**changes) -> SnapshotManifest:
    base = SnapshotManifest(
        id=new_snapshot_id(), kind="snapshot", alias="py", created_at=utc_now(),
        source={"sandbox_id": "sbx1"}, machine=shape(), memory_image=digest(1),
        memory_deltas=(digest(2), digest(3)), device_state=digest(4), vmstate_prefix=digest(5),
        disk_layers=(digest(6), digest(7)),
        runtime=RuntimeContext(
            env_vars={"A": "1"}, workdir="/home/user", user="user", start_cmd="python -m http.server",
        ),
        metadata={"team": "rl"}, sizes={digest(1): 512 << 20},
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def test_round_trip_is_lossless_and_stable():
    m = manifest()
    text = m.to_json()
    assert SnapshotManifest.from_json(text) == m
    assert SnapshotManifest.from_json(text.encode()) == m
    data = json.loads(text)
    assert data["format_version"] == FORMAT_VERSION
    assert set(data) == {
        "format_version", "id", "kind", "alias", "created_at", "source", "machine", "memory_image",
        "memory_deltas", "device_state", "vmstate_prefix", "disk_layers", "runtime", "metadata", "sizes",
    }  # fmt: skip
    assert data["memory_deltas"] == [digest(2), digest(3)]
    assert m.to_json() == text  # deterministic


def test_nested_parts_round_trip_alone():
    assert MachineShape.from_json(shape().to_json()) == shape()
    ctx = RuntimeContext(env_vars={"X": "y"}, ready_cmd="curl -f localhost:8000")
    assert RuntimeContext.from_json(ctx.to_json()) == ctx


def test_newer_format_refused_with_clear_error():
    data = json.loads(manifest().to_json())
    data["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(ManifestError, match=r"format_version 2 is newer than this aenv understands"):
        SnapshotManifest.from_json(json.dumps(data))
    del data["format_version"]
    with pytest.raises(ManifestError, match="no valid format_version"):
        SnapshotManifest.from_json(json.dumps(data))


def test_unknown_keys_ignored_missing_keys_named():
    data = json.loads(manifest().to_json())
    data["future_field"] = {"x": 1}
    assert SnapshotManifest.from_json(json.dumps(data)).id == data["id"]
    del data["device_state"], data["machine"]["vcpus"]
    with pytest.raises(ManifestError, match="missing device_state"):
        SnapshotManifest.from_json(json.dumps(data))
    with pytest.raises(ManifestError, match="not valid JSON"):
        SnapshotManifest.from_json("{")


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"id": "Has-Dash"}, "snapshot id"),
        ({"kind": "image"}, "kind"),
        ({"memory_image": "md5:abc"}, "memory_image"),
        ({"disk_layers": (digest(1), "sha256:XYZ")}, r"disk_layers\[1\]"),
        ({"disk_layers": ("../escape",)}, r"disk_layers\[0\]"),
        ({"created_at": "yesterday"}, "RFC 3339"),
        ({"created_at": "2025-01-01T00:00:00"}, "no UTC offset"),
        ({"metadata": {"n": 1}}, "metadata"),
        ({"sizes": {"a": "big"}}, "sizes"),
    ],
)
def test_invalid_manifest_fields_refused(changes, message):
    with pytest.raises(ManifestError, match=message):
        manifest(**changes)


def test_machine_shape_validation():
    with pytest.raises(ManifestError, match="accel"):
        shape(accel="hvf")
    with pytest.raises(ManifestError, match="vcpus"):
        shape(vcpus=True)
    with pytest.raises(ManifestError, match="positive"):
        shape(memory_mib=0)


def test_blobs_lists_every_repository_digest_once():
    m = manifest(disk_layers=("lmx1abc0123", digest(6), digest(1)))
    expected = [digest(1), digest(2), digest(3), digest(4), digest(5), digest(6), digest(100), digest(101)]
    assert m.blobs() == expected
    # "abc123" (tools) and "lmx1abc0123" (a qcow2 layer id) live outside the repository


def test_compatible_shapes_pass():
    shape().check_compatible(shape())


def test_mismatch_names_every_differing_field():
    with pytest.raises(SnapshotMismatch) as info:
        shape().check_compatible(shape(vcpus=4, accel="kvm"))
    assert str(info.value) == (
        "snapshot was taken with vcpus=2, accel=tcg but this node runs vcpus=4, accel=kvm"
    )
    assert isinstance(info.value, ValueError)


def test_mismatch_on_boot_artifacts_and_cmdline():
    with pytest.raises(SnapshotMismatch) as info:
        shape().check_compatible(shape(kernel_digest=digest(9), tools_digest="zzz", cmdline="console=hvc0"))
    message = str(info.value)
    assert f"kernel_digest={digest(100)}" in message and f"kernel_digest={digest(9)}" in message
    assert "tools_digest=abc123" in message and "tools_digest=zzz" in message
    assert "cmdline='console=ttyS0 quiet'" in message and "cmdline=console=hvc0" in message
    assert "vcpus" not in message


def test_snapshot_ids_are_lowercase_and_time_ordered():
    ids = []
    for _ in range(3):
        ids.append(new_snapshot_id())
        time.sleep(0.002)
    assert all(re.fullmatch(r"[a-z0-9]{20}", i) for i in ids)
    assert ids == sorted(ids)
    assert len({new_snapshot_id() for _ in range(1000)}) == 1000


def test_utc_now_is_rfc3339_utc():
    now = utc_now()
    assert now.endswith("Z")
    assert parse_timestamp(now).utcoffset().total_seconds() == 0
