"""The throwaway node of tests and bench: seeding a home from another's template, and the node
itself on a seeded home (it reuses the template, boots nothing to build one, leaves nothing)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from aenv.devnode import DevNode, DevNodeError, netns_names, seed_home
from aenv.paths import layers_dir, repository_dir
from aenv.repository.errors import SnapshotNotFound
from aenv.repository.manifest import MachineShape, RuntimeContext, SnapshotManifest, new_snapshot_id, utc_now
from aenv.repository.posix import SnapshotRepository
from aenv.runtime.layers import LayerStore

SLOT_FIRST = 14336  # apart from every other node the suite starts


def backing_file(layer: Path) -> str | None:
    info = subprocess.run(
        ["qemu-img", "info", "--output=json", "-U", str(layer)], capture_output=True, check=True, text=True
    )
    return json.loads(info.stdout).get("full-backing-filename")


def shape(repository: SnapshotRepository) -> MachineShape:
    kernel, initramfs, tools = (repository.put_bytes(part) for part in (b"kernel", b"initramfs", b"tools"))
    return MachineShape(
        qemu_version="10.0.2", machine_type="microvm", vcpus=1, memory_mib=512, accel="tcg",
        kernel_digest=kernel, initramfs_digest=initramfs, tools_digest=tools, cmdline="console=ttyS0",
    )  # fmt: skip


def seed(home: Path) -> SnapshotManifest:
    """A home shaped as a node leaves it after building `base` (a template on a two-layer disk),
    plus a lease and a sandbox, which seeding must not take."""
    repository = SnapshotRepository(repository_dir(home))
    layers = LayerStore(layers_dir(home))
    image = home / "root.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(image), "64M"], check=True)
    base = layers.import_base(image, "sha256:" + "ab" * 32)
    upper = asyncio.run(layers.create_upper(base))
    layers.seal(upper)
    memory = repository.put_bytes(b"memory")
    manifest = SnapshotManifest(
        id=new_snapshot_id(), kind="template", alias="base", created_at=utc_now(), source={},
        machine=shape(repository), memory_image=memory, memory_deltas=(),
        device_state=repository.put_bytes(b"devices"), vmstate_prefix=repository.put_bytes(b"prefix"),
        disk_layers=(base, upper), runtime=RuntimeContext(), metadata={}, sizes={memory: 6},
    )  # fmt: skip
    repository.commit(manifest)
    repository.acquire(manifest.id, "sandbox-a")
    (home / "sandboxes" / "sandbox-a").mkdir(parents=True)
    return manifest


def test_seeded_home_is_cheap_and_self_contained(tmp_path: Path):
    manifest = seed(tmp_path / "seed")
    home = tmp_path / "home"
    assert seed_home(home, tmp_path / "seed") == manifest.id

    source, target = (
        SnapshotRepository(repository_dir(tmp_path / "seed")),
        SnapshotRepository(repository_dir(home)),
    )
    assert target.get("base") == manifest
    for digest in manifest.blobs():  # immutable blobs: shared, not copied
        assert target.blob_path(digest).samefile(source.blob_path(digest))
    base, upper = manifest.disk_layers
    theirs, ours = LayerStore(layers_dir(tmp_path / "seed")), LayerStore(layers_dir(home))
    assert ours.path(base).samefile(theirs.path(base))  # no backing file: shared
    assert not ours.path(upper).samefile(theirs.path(upper))  # names its backing file: a copy
    assert backing_file(ours.path(upper)) == str(ours.path(base))
    assert backing_file(theirs.path(upper)) == str(theirs.path(base)), "the seed's layer was changed"
    assert ours.path(upper).stat().st_mode & 0o777 == 0o444
    assert target.holders(manifest.id) == []
    assert not (home / "sandboxes").exists()
    assert sorted(p.name for p in layers_dir(home).iterdir()) == sorted(
        f"{i}.qcow2" for i in manifest.disk_layers
    )

    assert seed_home(home, tmp_path / "seed") == manifest.id  # seeded already: left as it is


def test_seeding_needs_a_home_with_the_template(tmp_path: Path):
    with pytest.raises(DevNodeError, match="not a node home"):
        seed_home(tmp_path / "home", tmp_path / "nowhere")
    assert not (tmp_path / "nowhere").exists()
    SnapshotRepository(repository_dir(tmp_path / "empty"))
    with pytest.raises(DevNodeError, match="no base template"):
        seed_home(tmp_path / "home", tmp_path / "empty")
    with pytest.raises(SnapshotNotFound):
        SnapshotRepository(repository_dir(tmp_path / "home")).get("base")


@pytest.mark.vm
def test_node_on_a_seeded_home_builds_nothing_and_leaves_nothing(tmp_path: Path, template_seed: Path):
    if os.geteuid() != 0:
        pytest.skip("a node needs root (network namespaces)")
    template = SnapshotRepository(repository_dir(template_seed)).get("base")
    netns_before = netns_names()
    node = DevNode(
        tmp_path / "home", slot_first=SLOT_FIRST, seed=template_seed, warm_pool_size=1, log_format="json"
    )
    with node:
        listed = httpx.get(f"{node.url}/templates/base", headers={"X-API-Key": node.key}, timeout=30)
        assert listed.status_code == 200 and listed.json()["templateID"] == template.id
        created = httpx.post(
            f"{node.url}/sandboxes", json={"templateID": "base"}, headers={"X-API-Key": node.key}, timeout=120
        )
        assert created.status_code == 201, created.text
        assert node.qemu_pids()
    log = node.log_path.read_text()
    assert "building the base template" not in log and "listening on" in log
    # AENV_LOG_FORMAT=json: the node's lines are JSON objects, a create's with its sandbox's id
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert any(line["message"].startswith("aenv ") and line["logger"] == "aenv.node" for line in lines)
    sandbox_id = created.json()["sandboxID"]
    assert any(line.get("sandbox_id") == sandbox_id and "create" in line["message"] for line in lines)
    assert node.qemu_pids() == []
    assert {n for n in netns_names() - netns_before if n.startswith(f"aenv-s{SLOT_FIRST}-")} == set()
