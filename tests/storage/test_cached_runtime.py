"""Snapshots through an S3 repository (a real SeaweedFS): sealed qcow2 layers travel as blobs.

Node A seals a two-layer disk chain and commits it; node B (its own home and cache, the same
bucket) materializes the chain with backing paths of its own and reads A's data through a new
writable layer, as QEMU would. Real qcow2 files, read with qemu-io.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.devs3 import S3Server
from aenv.repository.manifest import MachineShape, RuntimeContext, SnapshotManifest, new_snapshot_id, utc_now
from aenv.repository.names import DIGEST_RE
from aenv.runtime import cache as cache_mod
from aenv.runtime.layers import LayerStore
from aenv.runtime.open import open_storage
from aenv.runtime.resolvers import CachedRuntime

MIB = 1 << 20


def qemu_io(image: Path, command: str) -> str:
    args = ["qemu-io", "-f", "qcow2", "-c", command, str(image)]
    done = subprocess.run(args, capture_output=True, text=True)
    assert done.returncode == 0 and "failed" not in done.stdout.lower() + done.stderr.lower(), done
    return done.stdout


def chain_files(image: Path) -> list[str]:
    done = subprocess.run(
        ["qemu-img", "info", "--backing-chain", "--output=json", str(image)], capture_output=True, text=True
    )
    return [entry["filename"] for entry in json.loads(done.stdout)]


@pytest.fixture
def make_node(s3_server: S3Server, tmp_path: Path):
    """A node's storage as `aenv server` opens it: settings, home, repository, cached runtime."""
    bucket = s3_server.new_bucket()
    nodes = []

    def make(name: str, capacity_mib: int = 1024):
        settings = Settings(
            home_path=tmp_path / name, repository=f"s3://{bucket}/aenv", s3_endpoint=s3_server.endpoint,
            s3_region=s3_server.region, s3_access_key=s3_server.access_key,
            s3_secret_key=s3_server.secret_key, cache_capacity_mib=capacity_mib,
        ).validate()  # fmt: skip
        storage = open_storage(settings, name)
        nodes.append(storage)
        layers = LayerStore(settings.home_path / "layers")
        assert isinstance(storage.runtime, CachedRuntime)
        return storage.repository, storage.runtime, layers

    yield make
    for storage in nodes:
        storage.close()


def sealed_chain(layers: LayerStore, tmp_path: Path) -> list[str]:
    """A base layer holding 'A's at 0 (and 9 MiB of 'D's: large enough to be loaded on demand)
    and an upper holding 'B's at 1 MiB, both sealed."""
    base = tmp_path / "base.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(base), "16M"], check=True)
    qemu_io(base, "write -P 0x41 0 64k")
    qemu_io(base, "write -P 0x44 4M 9M")
    base_id = layers.import_base(base, "sha256:" + secrets.token_hex(32))
    upper = asyncio.run(layers.create_upper(base_id))
    qemu_io(layers.path(upper), f"write -P 0x42 {MIB} 64k")
    layers.seal(base_id)
    layers.seal(upper)
    return [base_id, upper]


def snapshot_manifest(repo, disk_layers: tuple[str, ...], memory: bytes) -> SnapshotManifest:
    boot = [repo.put_bytes(f"{part}-{secrets.token_hex(4)}".encode()) for part in ("kern", "init", "tools")]
    header = b"QEVM\x00\x00\x00\x03"
    machine = MachineShape(
        qemu_version="10.0.2", machine_type="microvm", vcpus=1, memory_mib=256, accel="tcg",
        kernel_digest=boot[0], initramfs_digest=boot[1], tools_digest=boot[2], cmdline="console=ttyS0",
    )  # fmt: skip
    return SnapshotManifest(
        id=new_snapshot_id(), kind="snapshot", alias=None, created_at=utc_now(), source={},
        machine=machine, memory_image=repo.put_bytes(memory), memory_deltas=(),
        device_state=repo.put_bytes(header + b"\x04devices"),
        vmstate_prefix=repo.put_bytes(header + b"prefix"),
        disk_layers=disk_layers, runtime=RuntimeContext(), metadata={}, sizes={},
    )  # fmt: skip


def test_a_disk_chain_sealed_on_one_node_runs_on_another(make_node, tmp_path: Path):
    repo_a, runtime_a, layers_a = make_node("node-a")
    repo_b, runtime_b, layers_b = make_node("node-b")
    digests = runtime_a.publish_layers(sealed_chain(layers_a, tmp_path))
    assert all(DIGEST_RE.fullmatch(d) for d in digests)
    manifest = snapshot_manifest(repo_a, digests, b"memory image")
    repo_a.commit(manifest)

    leased = repo_b.acquire(manifest.id, "sbx-b")
    runtime_b.prepare(leased)
    top = asyncio.run(layers_b.create_upper_over(runtime_b.top_layer(leased)))
    disk = layers_b.path(top)
    qemu_io(disk, "read -P 0x41 0 64k")
    qemu_io(disk, f"read -P 0x42 {MIB} 64k")
    node_b_home = str(tmp_path / "node-b")
    assert all(path.startswith(node_b_home) for path in chain_files(disk))  # no path of node A
    # The bottom layer names no backing file: B reads it on demand through its FUSE mount.
    assert chain_files(disk)[-1] == str(runtime_b.lazy.path(digests[0].removeprefix("sha256:")))
    assert runtime_b.cache.is_partial(digests[0].removeprefix("sha256:"))
    qemu_io(disk, "read -P 0x44 4M 9M")
    assert runtime_b.memory_image(leased).read_bytes() == b"memory image"
    assert runtime_b.template_stream(leased).read_bytes().startswith(b"QEVM")
    before = runtime_b.cache.stats()
    runtime_b.prepare(leased)
    after = runtime_b.cache.stats()
    assert after.misses == before.misses and after.hits > before.hits  # all local now
    assert before.fetched_bytes > 0 and before.used_bytes <= before.capacity_bytes


def test_a_snapshot_of_a_materialized_chain_travels_back(make_node, tmp_path: Path):
    """B writes over A's chain, seals, publishes; A materializes B's three-layer chain."""
    repo_a, runtime_a, layers_a = make_node("node-a")
    repo_b, runtime_b, layers_b = make_node("node-b")
    first = snapshot_manifest(repo_a, runtime_a.publish_layers(sealed_chain(layers_a, tmp_path)), b"m1")
    repo_a.commit(first)
    runtime_b.prepare(repo_b.acquire(first.id, "sbx-b"))
    top = asyncio.run(layers_b.create_upper_over(runtime_b.top_layer(first)))
    qemu_io(layers_b.path(top), f"write -P 0x43 {2 * MIB} 64k")
    layers_b.seal(top)
    second = snapshot_manifest(repo_b, runtime_b.publish_layers([*first.disk_layers, top]), b"m2")
    repo_b.commit(second)
    runtime_a.prepare(repo_a.acquire(second.id, "sbx-a"))
    disk = layers_a.path(asyncio.run(layers_a.create_upper_over(runtime_a.top_layer(second))))
    for pattern, offset in ((0x41, 0), (0x42, MIB), (0x43, 2 * MIB)):
        qemu_io(disk, f"read -P {pattern:#x} {offset} 64k")


def test_a_small_cache_evicts_cold_snapshots_never_leased_ones(make_node, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(cache_mod, "RECENT_SECONDS", -1.0)
    repo_a, runtime_a, layers_a = make_node("node-a")
    repo_b, runtime_b, _ = make_node("node-b", capacity_mib=3)
    digests = runtime_a.publish_layers(sealed_chain(layers_a, tmp_path))
    manifests = []
    for i in range(3):
        manifest = snapshot_manifest(repo_a, digests, bytes([i + 1]) * (2 * MIB))
        repo_a.commit(manifest)
        manifests.append(manifest)
    in_use = repo_b.acquire(manifests[0].id, "sbx-keep")
    runtime_b.prepare(in_use)
    pinned = runtime_b.memory_image(in_use)
    for i, manifest in enumerate(manifests[1:], start=2):
        repo_b.acquire(manifest.id, "sbx-short")
        runtime_b.prepare(manifest)
        assert runtime_b.memory_image(manifest).read_bytes() == bytes([i]) * (2 * MIB)
        repo_b.release(manifest.id, "sbx-short")
    stats = runtime_b.cache.stats()
    assert stats.evictions > 0 and pinned.exists()
    assert pinned.read_bytes() == b"\x01" * (2 * MIB)
    assert runtime_b.top_layer(in_use).exists()
