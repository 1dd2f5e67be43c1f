"""The repository contract, one suite for every backend (posix_fs, and s3 on a real SeaweedFS).

Two repository instances with different node names over one store stand for two nodes sharing
a repository.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from aenv.repository.errors import (
    AliasConflict,
    DigestMismatch,
    MissingBlob,
    SnapshotExists,
    SnapshotInUse,
    SnapshotNotFound,
)
from aenv.repository.manifest import MachineShape, RuntimeContext, SnapshotManifest, new_snapshot_id, utc_now
from aenv.repository.posix import SnapshotRepository

MIB = 1 << 20


def shape() -> MachineShape:
    return MachineShape(
        qemu_version="10.0.2", machine_type="microvm", vcpus=1, memory_mib=256, accel="tcg",
        kernel_digest="k1", initramfs_digest="i1", tools_digest="t1", cmdline="console=ttyS0",
    )  # fmt: skip


def manifest_of(repo, tag: str, *, alias: str | None = None, extra: tuple[str, ...] = ()) -> SnapshotManifest:
    """A manifest over three small blobs unique to ``tag`` (stored now) plus ``extra`` digests."""
    own = [repo.put_bytes(f"{tag}-{part}".encode()) for part in ("mem", "dev", "prefix")]
    return SnapshotManifest(
        id=new_snapshot_id(), kind="snapshot", alias=alias, created_at=utc_now(), source={},
        machine=shape(), memory_image=own[0], memory_deltas=extra, device_state=own[1],
        vmstate_prefix=own[2], disk_layers=(), runtime=RuntimeContext(), metadata={}, sizes={},
    )  # fmt: skip


def committed(repo, tag: str, **kwargs) -> SnapshotManifest:
    manifest = manifest_of(repo, tag, **kwargs)
    repo.commit(manifest)
    return manifest


def sparse_file(path: Path, size: int, data: bytes, at: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
        f.seek(at)
        f.write(data)
    return path


def corrupt(repo, digest: str) -> None:
    """Replace a stored blob's bytes behind the repository's back."""
    if isinstance(repo, SnapshotRepository):
        path = repo.blob_path(digest)
        os.chmod(path, 0o644)
        path.write_bytes(b"not what was stored")
    else:
        repo._client.put_object(Bucket=repo._bucket, Key=repo._blob_key(digest), Body=b"not what was stored")


def test_blobs_round_trip_verified_and_sparse(open_repo, tmp_path: Path):
    repo = open_repo()
    src = sparse_file(tmp_path / "image", 12 * MIB, b"data in the middle", 7 * MIB)  # > one part
    digest = repo.put_blob(src)
    assert digest == "sha256:" + hashlib.sha256(src.read_bytes()).hexdigest()
    assert repo.has_blob(digest) and not repo.has_blob("sha256:" + "0" * 64)
    repo.verify_blob(digest)
    other = open_repo("node-b")
    other.fetch_blob(digest, tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == src.read_bytes()
    assert os.stat(tmp_path / "copy").st_blocks * 512 < 2 * MIB  # the zeros were not written
    moved = sparse_file(tmp_path / "moved", MIB, b"moved", 0)
    assert repo.put_blob(moved, move=True) == repo.put_bytes(moved_bytes := b"moved".ljust(MIB, b"\0"))
    assert not moved.exists() and len(moved_bytes) == MIB
    with pytest.raises(DigestMismatch):
        repo.put_blob(sparse_file(tmp_path / "x", 10, b"x", 0), digest=digest)


def test_commit_then_visible_on_every_node(open_repo):
    a, b = open_repo("node-a"), open_repo("node-b")
    manifest = committed(a, "one", alias="web")
    assert b.get("web") == manifest and b.resolve(manifest.id) == manifest.id
    assert [m.id for m in b.list()] == [manifest.id]
    assert b.list("template") == []


def test_commit_refuses_missing_blobs_and_shows_nothing(open_repo):
    repo = open_repo()
    manifest = manifest_of(repo, "one", extra=("sha256:" + "1" * 64,))
    with pytest.raises(MissingBlob):
        repo.commit(manifest)
    assert repo.list() == []


def test_two_nodes_committing_one_id_have_one_winner(open_repo):
    a, b = open_repo("node-a"), open_repo("node-b")
    manifest = manifest_of(a, "one")
    results: list[object] = []

    def commit(repo) -> None:
        try:
            repo.commit(manifest)
            results.append("ok")
        except SnapshotExists as exc:
            results.append(exc)

    threads = [threading.Thread(target=commit, args=(r,)) for r in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count("ok") == 1 and len(results) == 2
    with pytest.raises(SnapshotExists):
        a.commit(manifest)


def test_one_node_claims_a_snapshot_and_the_claim_goes_with_it(open_repo):
    a, b = open_repo("node-a"), open_repo("node-b")
    manifest = committed(a, "paused")
    winners: list[str] = []
    threads = [threading.Thread(target=lambda r=r: winners.append(r.claim(manifest.id))) for r in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(winners)) == 1 and a.claimant(manifest.id) == b.claimant(manifest.id) == winners[0]
    loser, winner = (a, b) if winners[0] == "node-b" else (b, a)
    loser.unclaim(manifest.id)  # not its claim: nothing changes
    assert loser.claim(manifest.id) == winner.node
    winner.unclaim(manifest.id)  # a failed take-over gives the snapshot back
    assert loser.claim(manifest.id) == loser.node
    loser.delete(manifest.id)
    assert winner.claimant(manifest.id) is None


def test_a_pending_mark_is_seen_by_id_and_alias_on_every_node_until_it_goes_stale(open_repo):
    a, b = open_repo("node-a", lease_ttl=2.0), open_repo("node-b", lease_ttl=2.0)
    a.heartbeat()
    snapshot_id = new_snapshot_id()
    a.mark_pending(snapshot_id, "coming")
    for name in (snapshot_id, "coming"):
        mark = b.pending_mark(name)
        assert mark is not None and (mark.snapshot_id, mark.node, mark.failure, mark.stale) == (
            snapshot_id, "node-a", None, False,
        )  # fmt: skip
    a.mark_pending(snapshot_id, "coming", failure="committing it failed (disk full)")
    assert b.pending_mark("coming").failure == "committing it failed (disk full)"
    a.unmark_pending(snapshot_id, "coming")
    assert b.pending_mark(snapshot_id) is None and b.pending_mark("coming") is None
    assert b.pending_mark("Not A Name") is None
    a.mark_pending(snapshot_id)
    time.sleep(3.5)  # node-a stops heartbeating: it died, and its commit never comes
    assert b.pending_mark(snapshot_id).stale
    b.heartbeat()
    b.gc()
    assert a.pending_mark(snapshot_id) is None


def test_aliases_bind_once_across_nodes(open_repo):
    a, b = open_repo("node-a"), open_repo("node-b")
    first = committed(a, "one", alias="app")
    second = manifest_of(b, "two", alias="app")
    with pytest.raises(AliasConflict):
        b.commit(second)
    assert not b.is_live(second.id)  # the loser's snapshot never became visible
    other = committed(b, "three")
    with pytest.raises(AliasConflict):
        b.set_alias("app", other.id)
    a.remove_alias("app")
    with pytest.raises(SnapshotNotFound):
        a.resolve("app")
    b.set_alias("app", other.id)
    assert a.get("app").id == other.id and a.get(first.id).alias is None
    a.delete(other.id)
    with pytest.raises(SnapshotNotFound):
        b.resolve("app")  # an alias of a deleted snapshot is unbound
    b.set_alias("app", first.id)
    assert a.resolve("app") == first.id


def test_deferred_delete_while_leased(open_repo):
    a, b = open_repo("node-a"), open_repo("node-b")
    manifest = committed(a, "one", alias="dev")
    assert a.acquire("dev", "sbx1").id == manifest.id
    with pytest.raises(SnapshotInUse):
        b.delete(manifest.id, defer=False)
    assert b.get(manifest.id).id == manifest.id  # a refused delete changed nothing
    assert b.delete(manifest.id) is False
    with pytest.raises(SnapshotNotFound):
        b.get(manifest.id)
    with pytest.raises(SnapshotNotFound):
        b.acquire(manifest.id, "sbx2")  # hidden: no new users
    assert a.leased(manifest.id, "sbx1").id == manifest.id and b.holders(manifest.id) == ["sbx1"]
    a.release(manifest.id, "sbx1")  # the last release completes the delete
    assert b.list() == [] and not b.is_live(manifest.id)
    b.gc(grace_seconds=0)
    assert not b.has_blob(manifest.memory_image)


def test_a_lease_handed_on_keeps_the_snapshot_pinned(open_repo):
    """A warm VM's lease goes to the sandbox it became, also after a deferred delete; without a
    lease to hand on, the new holder acquires one (which a hidden snapshot refuses)."""
    a, b = open_repo("node-a"), open_repo("node-b")
    manifest = committed(a, "one")
    a.acquire(manifest.id, "w1")
    a.transfer(manifest.id, "w1", "sbx1")
    assert b.holders(manifest.id) == ["sbx1"] and a.leased(manifest.id, "sbx1").id == manifest.id
    a.transfer(manifest.id, "w1", "sbx2")  # nothing to hand on: sbx2 acquires its own
    assert b.holders(manifest.id) == ["sbx1", "sbx2"]
    assert b.delete(manifest.id) is False
    with pytest.raises(SnapshotNotFound):
        a.transfer(manifest.id, "w9", "sbx3")
    a.transfer(manifest.id, "sbx2", "sbx4")
    assert b.holders(manifest.id) == ["sbx1", "sbx4"] and a.leased(manifest.id, "sbx4").id == manifest.id
    a.release(manifest.id, "sbx1")
    a.release(manifest.id, "sbx4")  # the last release completes the delete
    assert not b.is_live(manifest.id)


def test_leases_of_a_dead_node_expire(open_repo):
    a = open_repo("node-a", lease_ttl=2.0)
    b = open_repo("node-b", lease_ttl=2.0)
    manifest = committed(a, "one")
    a.acquire(manifest.id, "sbx1")
    assert b.holders(manifest.id) == ["sbx1"] and b.delete(manifest.id) is False
    b.heartbeat()
    time.sleep(3.5)  # node-a stops heartbeating: it died
    assert b.holders(manifest.id) == []
    assert manifest.id in a.local_leases() and a.holders(manifest.id) == ["sbx1"]  # its own stay
    b.gc(grace_seconds=0)
    with pytest.raises(SnapshotNotFound):
        a.leased(manifest.id, "sbx1")
    assert not b.has_blob(manifest.device_state)


def test_live_heartbeat_keeps_leases(open_repo):
    a = open_repo("node-a", lease_ttl=3.0)
    b = open_repo("node-b", lease_ttl=3.0)
    manifest = committed(a, "one")
    a.acquire(manifest.id, "sbx1")
    for _ in range(3):
        time.sleep(1.5)
        a.heartbeat()
        assert b.holders(manifest.id) == ["sbx1"]
    b.gc(grace_seconds=0)
    assert a.leased(manifest.id, "sbx1").id == manifest.id


def test_gc_with_two_nodes_spares_blobs_awaiting_their_manifest(open_repo, tmp_path: Path):
    a = open_repo("node-a", grace_seconds=3600)
    b = open_repo("node-b", grace_seconds=3600)
    shared = a.put_bytes(b"shared base")
    kept = committed(a, "kept", extra=(shared,))
    pending = manifest_of(a, "pending", extra=(shared,))  # blobs stored, manifest not yet
    orphan = b.put_bytes(b"orphan")
    b.gc()
    assert all(a.has_blob(d) for d in pending.blobs())  # younger than the grace period
    a.commit(pending)
    assert b.delete(pending.id) is True
    b.gc(grace_seconds=0)
    assert not a.has_blob(orphan) and not a.has_blob(pending.memory_image)
    assert a.has_blob(shared) and all(a.has_blob(d) for d in kept.blobs())
    assert [m.id for m in a.list()] == [kept.id]


def test_reused_blob_is_young_again(open_repo):
    """Storing a blob that exists protects it from a gc until the manifest naming it commits."""
    a, b = open_repo("node-a"), open_repo("node-b")
    digest = a.put_bytes(b"old blob")
    time.sleep(2.2)
    assert a.put_bytes(b"old blob") == digest
    b.gc(grace_seconds=2)
    assert a.has_blob(digest)


def test_interrupted_upload_leaves_no_snapshot(open_repo, backend: str, tmp_path: Path, monkeypatch):
    repo = open_repo()
    big = sparse_file(tmp_path / "image", 12 * MIB, os.urandom(MIB), 5 * MIB)
    manifest = manifest_of(repo, "one")

    class Killed(BaseException):
        pass

    if backend == "s3":
        real = repo._client.upload_part

        def dies_on_second_part(**kwargs):
            if kwargs["PartNumber"] == 2:
                raise Killed
            return real(**kwargs)

        monkeypatch.setattr(repo._client, "upload_part", dies_on_second_part)
        monkeypatch.setattr(repo._client, "abort_multipart_upload", lambda **kwargs: None)  # no cleanup
    else:
        monkeypatch.setattr(os, "link", lambda *args, **kwargs: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):
        repo.put_blob(big)
    monkeypatch.undo()
    digest = "sha256:" + hashlib.sha256(big.read_bytes()).hexdigest()
    assert not repo.has_blob(digest)
    with pytest.raises(MissingBlob):
        repo.commit(manifest.__class__(**{**manifest.__dict__, "memory_deltas": (digest,)}))
    assert repo.list() == []
    repo.gc(grace_seconds=0)
    if backend == "s3":
        assert repo._client.list_multipart_uploads(Bucket=repo._bucket).get("Uploads", []) == []
    assert repo.put_blob(big) == digest  # a retry completes


def test_corrupted_blob_is_detected_on_read(open_repo, tmp_path: Path):
    repo = open_repo()
    manifest = committed(repo, "one")
    corrupt(repo, manifest.memory_image)
    with pytest.raises(DigestMismatch):
        repo.verify_blob(manifest.memory_image)
    with pytest.raises(DigestMismatch):
        open_repo("node-b").fetch_blob(manifest.memory_image, tmp_path / "copy")
    assert not (tmp_path / "copy").exists()
    with pytest.raises(MissingBlob):
        repo.fetch_blob("sha256:" + "2" * 64, tmp_path / "missing")
