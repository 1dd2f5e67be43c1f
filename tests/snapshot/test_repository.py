"""Snapshot repository: blobs, atomic commits, catalog, aliases, leases, deletion and gc."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from aenv.repository import posix as repo_mod
from aenv.repository.errors import (
    AliasConflict,
    CorruptManifest,
    DigestMismatch,
    InvalidDigest,
    InvalidName,
    MissingBlob,
    RepositoryError,
    SnapshotExists,
    SnapshotInUse,
    SnapshotNotFound,
)
from aenv.repository.files import data_extents, file_digest, sparse_copy
from aenv.repository.manifest import MachineShape, RuntimeContext, SnapshotManifest, new_snapshot_id, utc_now
from aenv.repository.posix import SnapshotRepository

MIB = 1 << 20


@pytest.fixture
def repo(tmp_path: Path) -> SnapshotRepository:
    return SnapshotRepository(tmp_path / "repo", grace_seconds=0)


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def shape() -> MachineShape:
    return MachineShape(
        qemu_version="10.0.2", machine_type="microvm", vcpus=2, memory_mib=512, accel="tcg",
        kernel_digest="k1", initramfs_digest="i1", tools_digest="t1", cmdline="console=ttyS0",
    )  # fmt: skip


def make_snapshot(
    repo: SnapshotRepository, tag: str, *, alias: str | None = None, kind: str = "snapshot",
    created_at: str | None = None, shared: list[str] | None = None,
) -> SnapshotManifest:  # fmt: skip
    """Store four small blobs unique to ``tag`` (plus ``shared`` digests) and build a manifest."""
    own = [repo.put_bytes(f"{tag}-{part}".encode()) for part in ("mem", "dev", "prefix", "disk")]
    return SnapshotManifest(
        id=new_snapshot_id(), kind=kind, alias=alias, created_at=created_at or utc_now(),
        source={"sandbox_id": f"sbx-{tag}"}, machine=shape(), memory_image=own[0], memory_deltas=(),
        device_state=own[1], vmstate_prefix=own[2], disk_layers=(*(shared or []), own[3]),
        runtime=RuntimeContext(), metadata={}, sizes={},
    )  # fmt: skip


def committed(repo: SnapshotRepository, tag: str, **kwargs) -> SnapshotManifest:
    m = make_snapshot(repo, tag, **kwargs)
    repo.commit(m)
    return m


def visible_files(root: Path) -> list[str]:
    """Every file in the catalog directories, temporaries included."""
    return sorted(
        str(p.relative_to(root)) for d in ("manifests", "aliases", "deleted") for p in (root / d).iterdir()
    )


# ---- hashing and copying -------------------------------------------------------------------------


def test_sparse_hash_equals_plain_sha256(tmp_path: Path):
    path = tmp_path / "mem.img"
    with open(path, "wb") as f:
        f.truncate(64 * MIB)
        for offset in (0, 5 * MIB + 123, 40 * MIB, 64 * MIB - 10):
            f.seek(offset)
            f.write(os.urandom(4000)[: 64 * MIB - offset])
    st = path.stat()
    assert st.st_blocks * 512 < 4 * MIB, "test file should be sparse"
    assert len(list(data_extents(os.open(path, os.O_RDONLY), st.st_size))) >= 3
    assert file_digest(path) == sha(path.read_bytes())


@pytest.mark.parametrize("content", [b"", b"x", os.urandom(3 * MIB + 17)])
def test_hash_of_dense_and_empty_files(tmp_path: Path, content: bytes):
    assert file_digest(write(tmp_path / "f", content)) == sha(content)


def test_hash_of_file_that_is_all_hole(tmp_path: Path):
    path = tmp_path / "holes"
    with open(path, "wb") as f:
        f.truncate(8 * MIB + 5)
    assert file_digest(path) == sha(bytes(8 * MIB + 5))


def test_large_sparse_image_hashes_quickly(tmp_path: Path):
    path = tmp_path / "big.img"
    with open(path, "wb") as f:
        f.truncate(512 * MIB)
        f.seek(100 * MIB)
        f.write(b"guest")
    started = time.monotonic()
    file_digest(path)
    assert time.monotonic() - started < 5  # no reads of holes; zeros are still hashed


def test_sparse_copy_keeps_contents_and_holes(tmp_path: Path):
    src = tmp_path / "src"
    with open(src, "wb") as f:
        f.truncate(32 * MIB)
        f.seek(3 * MIB)
        f.write(os.urandom(MIB))
        f.seek(20 * MIB)
        f.write(bytes(2 * MIB))  # allocated zeros: written as a hole in the copy
        f.write(b"tail")
    dst = tmp_path / "dst"
    sparse_copy(src, dst)
    assert dst.read_bytes() == src.read_bytes()
    assert dst.stat().st_size == 32 * MIB
    assert dst.stat().st_blocks * 512 <= 2 * MIB
    with pytest.raises(FileExistsError):
        sparse_copy(src, dst)


def test_sparse_copy_of_trailing_hole(tmp_path: Path):
    src = tmp_path / "src"
    with open(src, "wb") as f:
        f.write(b"head")
        f.truncate(10 * MIB)
    sparse_copy(src, tmp_path / "dst")
    assert (tmp_path / "dst").read_bytes() == src.read_bytes()


# ---- blobs ---------------------------------------------------------------------------------------


def test_put_blob_hardlinks_and_dedups(repo: SnapshotRepository, tmp_path: Path):
    a = write(tmp_path / "a", b"same bytes")
    b = write(tmp_path / "b", b"same bytes")
    d1 = repo.put_blob(a)
    d2 = repo.put_blob(b)
    assert d1 == d2 == sha(b"same bytes")
    blob = repo.blob_path(d1)
    assert list(blob.parent.iterdir()) == [blob]
    assert blob.stat().st_ino == a.stat().st_ino  # hardlinked, not copied
    assert blob.stat().st_nlink == 2  # the blob and a; b was not linked
    assert b.stat().st_nlink == 1
    assert blob.stat().st_mode & 0o777 == 0o444
    assert repo.has_blob(d1)
    repo.verify_blob(d1)


def test_put_blob_move_renames_or_drops_duplicate(repo: SnapshotRepository, tmp_path: Path):
    a = write(tmp_path / "a", b"moved")
    digest = repo.put_blob(a, move=True)
    assert not a.exists() and repo.blob_path(digest).stat().st_nlink == 1
    b = write(tmp_path / "b", b"moved")
    assert repo.put_blob(b, move=True, digest=digest) == digest
    assert not b.exists()
    # storing a blob from its own path is a no-op, not a deletion
    assert repo.put_blob(repo.blob_path(digest), move=True) == digest
    assert repo.has_blob(digest)


def test_put_blob_verifies_given_digest(repo: SnapshotRepository, tmp_path: Path):
    a = write(tmp_path / "a", b"content")
    with pytest.raises(DigestMismatch, match="hashes to"):
        repo.put_blob(a, digest=sha(b"other"))
    with pytest.raises(InvalidDigest):
        repo.put_blob(a, digest="sha256:nothex")
    assert list(repo.root.joinpath("blobs", "sha256").iterdir()) == []


@pytest.mark.parametrize("move", [False, True])
def test_put_blob_copies_across_filesystems(
    repo: SnapshotRepository, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, move: bool
) -> None:
    src = tmp_path / "sparse"
    with open(src, "wb") as f:
        f.truncate(16 * MIB)
        f.write(b"start")
    expected = sha(src.read_bytes())

    def cross_device(real):
        def call(a, b, *args, **kwargs):
            if Path(a) == src:
                raise OSError(errno.EXDEV, "Invalid cross-device link")
            return real(a, b, *args, **kwargs)

        return call

    monkeypatch.setattr(os, "link", cross_device(os.link))
    monkeypatch.setattr(os, "rename", cross_device(os.rename))
    src_ino = src.stat().st_ino
    digest = repo.put_blob(src, move=move)
    assert digest == expected
    blob = repo.blob_path(digest)
    assert blob.stat().st_ino != src_ino
    assert blob.stat().st_blocks * 512 < MIB  # the copy stayed sparse
    assert blob.stat().st_mode & 0o777 == 0o444
    assert src.exists() is not move
    repo.verify_blob(digest)
    assert list((repo.root / "staging").iterdir()) == []


def test_put_bytes_and_verify_detects_corruption(repo: SnapshotRepository):
    digest = repo.put_bytes(b"device state")
    assert digest == sha(b"device state")
    assert repo.put_bytes(b"device state") == digest
    path = repo.blob_path(digest)
    os.chmod(path, 0o644)
    path.write_bytes(b"tampered")
    with pytest.raises(DigestMismatch, match="corrupt"):
        repo.verify_blob(digest)
    with pytest.raises(MissingBlob):
        repo.verify_blob(sha(b"never stored"))


def test_blob_path_refuses_bad_digests(repo: SnapshotRepository):
    for bad in ("sha256:../../etc/passwd", "md5:" + "0" * 32, "sha256:" + "A" * 64):
        with pytest.raises(InvalidDigest):
            repo.blob_path(bad)


# ---- commit and catalog --------------------------------------------------------------------------


def test_commit_get_resolve(repo: SnapshotRepository):
    m = committed(repo, "one", alias="python-3.12")
    assert repo.get(m.id) == m
    assert repo.get("python-3.12") == m
    assert repo.resolve("python-3.12") == m.id
    assert (repo.root / "aliases" / "python-3.12").read_text() == m.id
    with pytest.raises(SnapshotNotFound, match="'nope' not found"):
        repo.get("nope")
    with pytest.raises(SnapshotNotFound):
        repo.get("../manifests/x")


def test_commit_refuses_existing_id_and_missing_blobs(repo: SnapshotRepository):
    m = committed(repo, "one")
    with pytest.raises(SnapshotExists):
        repo.commit(m)
    lacking = dataclasses.replace(make_snapshot(repo, "two"), memory_deltas=(sha(b"absent"),))
    with pytest.raises(MissingBlob, match=sha(b"absent")):
        repo.commit(lacking)
    with pytest.raises(SnapshotNotFound):
        repo.get(lacking.id)


def test_list_orders_newest_first_and_filters_kind(repo: SnapshotRepository):
    old = committed(repo, "old", created_at="2024-01-01T00:00:00.000Z", kind="template")
    tie_b = dataclasses.replace(make_snapshot(repo, "b", created_at="2024-06-01T00:00:00Z"), id="tieb")
    tie_a = dataclasses.replace(make_snapshot(repo, "a", created_at="2024-06-01T00:00:00+00:00"), id="tiea")
    repo.commit(tie_b)
    repo.commit(tie_a)
    new = committed(repo, "new", created_at="2025-01-01T00:00:00.000Z", kind="template")
    assert [m.id for m in repo.list()] == [new.id, tie_a.id, tie_b.id, old.id]
    assert [m.id for m in repo.list(kind="template")] == [new.id, old.id]
    assert repo.list(kind="snapshot") == [tie_a, tie_b]


def test_alias_conflict_and_rebinding(repo: SnapshotRepository):
    a = committed(repo, "a", alias="base")
    b = make_snapshot(repo, "b", alias="base")
    with pytest.raises(AliasConflict, match=f"alias 'base' already points to '{a.id}'"):
        repo.commit(b)
    with pytest.raises(SnapshotNotFound):
        repo.get(b.id)  # a refused commit publishes nothing
    repo.set_alias("base", a.id)  # same target: no-op
    repo.remove_alias("base")
    assert repo.get(a.id).alias is None
    repo.commit(b)
    assert repo.resolve("base") == b.id
    repo.set_alias("second", a.id)
    assert repo.get(a.id).alias == "second"
    assert {m.id: m.alias for m in repo.list()} == {a.id: "second", b.id: "base"}
    with pytest.raises(AliasConflict):
        repo.set_alias("second", b.id)
    with pytest.raises(SnapshotNotFound):
        repo.remove_alias("never-bound")
    assert issubclass(AliasConflict, RepositoryError)


@pytest.mark.parametrize("bad", ["", "Upper", "-lead", ".lead", "has space", "a/b", "x" * 64, "ü"])
def test_invalid_alias_names(repo: SnapshotRepository, bad: str):
    with pytest.raises(InvalidName):
        repo.commit(make_snapshot(repo, "x", alias=bad))
    with pytest.raises(InvalidName):
        repo.set_alias(bad, "whatever")


def test_valid_alias_edge_names(repo: SnapshotRepository):
    m = committed(repo, "a", alias="a")
    for name in ("0", "node-20.x_lts", "x" * 63):
        repo.set_alias(name, m.id)
        assert repo.resolve(name) == m.id


def test_dangling_alias_is_unbound(repo: SnapshotRepository):
    (repo.root / "aliases" / "ghost").write_text("doesnotexist")
    with pytest.raises(SnapshotNotFound):
        repo.resolve("ghost")
    m = committed(repo, "a", alias="ghost")  # a dangling alias does not conflict
    assert repo.resolve("ghost") == m.id


def test_unreadable_manifest_skipped_by_list_refused_by_get(repo: SnapshotRepository):
    good = committed(repo, "good")
    bad = committed(repo, "bad")
    path = repo.root / "manifests" / f"{bad.id}.json"
    path.write_text(path.read_text().replace('"format_version": 1', '"format_version": 99'))
    assert [m.id for m in repo.list()] == [good.id]
    with pytest.raises(CorruptManifest, match="newer than this aenv"):
        repo.get(bad.id)
    # gc keeps the blobs of a manifest it cannot parse
    assert repo.gc().removed_blobs == ()
    assert all(repo.has_blob(d) for d in bad.blobs())


# ---- crash safety --------------------------------------------------------------------------------


def crash_in_child(action, *, crash_on_replace: int) -> None:
    """Run ``action`` in a forked child that dies abruptly at its n-th os.replace (1-based)."""
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            calls = 0
            real = os.replace

            def dying_replace(a, b, *args, **kwargs):
                nonlocal calls
                calls += 1
                if calls == crash_on_replace:
                    os._exit(17)
                return real(a, b, *args, **kwargs)

            os.replace = dying_replace
            action()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 17, "child should have crashed mid-commit"


@pytest.mark.parametrize("crash_on_replace", [1, 2])
def test_crash_during_commit_leaves_nothing_visible(repo: SnapshotRepository, crash_on_replace: int):
    m = make_snapshot(repo, "crash", alias="crashy")
    crash_in_child(lambda: repo.commit(m), crash_on_replace=crash_on_replace)
    # 1st replace = alias binding, 2nd = manifest: either way the snapshot is not there
    with pytest.raises(SnapshotNotFound):
        repo.get(m.id)
    with pytest.raises(SnapshotNotFound):
        repo.get("crashy")
    assert repo.list() == []
    debris = visible_files(repo.root)
    assert debris, "the crash should have left a temporary or a dangling alias"
    report = repo.gc()
    assert visible_files(repo.root) == []
    assert sorted(report.removed_blobs) == sorted(m.blobs())
    assert report.removed_aliases == (("crashy",) if crash_on_replace == 2 else ())
    # and the same commit now succeeds
    for part in ("mem", "dev", "prefix", "disk"):
        repo.put_bytes(f"crash-{part}".encode())
    repo.commit(m)
    assert repo.get("crashy") == m


def test_failed_write_cleans_up_its_temporary(repo: SnapshotRepository, monkeypatch):
    m = make_snapshot(repo, "fail", alias="failing")

    def broken_replace(a, b):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(repo_mod.os, "replace", broken_replace)
    with pytest.raises(OSError, match="No space"):
        repo.commit(m)
    monkeypatch.undo()
    assert visible_files(repo.root) == []
    with pytest.raises(SnapshotNotFound):
        repo.get(m.id)


# ---- leases and deletion -------------------------------------------------------------------------


def test_delete_unleased_removes_snapshot_and_its_own_blobs(repo: SnapshotRepository):
    shared = repo.put_bytes(b"shared base layer")
    a = committed(repo, "a", alias="a", shared=[shared])
    b = committed(repo, "b", shared=[shared])
    assert repo.delete("a") is True
    with pytest.raises(SnapshotNotFound):
        repo.get(a.id)
    with pytest.raises(SnapshotNotFound):
        repo.resolve("a")
    assert not (repo.root / "aliases" / "a").exists()
    assert repo.has_blob(shared)  # still used by b
    assert all(repo.has_blob(d) for d in b.blobs())
    assert not any(repo.has_blob(d) for d in set(a.blobs()) - {shared})
    with pytest.raises(SnapshotNotFound):
        repo.delete(a.id)


def test_delete_respects_grace_period_for_fresh_blobs(tmp_path: Path):
    repo = SnapshotRepository(tmp_path / "repo", grace_seconds=3600)
    a = committed(repo, "a")
    repo.delete(a.id)
    assert all(repo.has_blob(d) for d in a.blobs())  # a concurrent commit may still want them
    assert repo.gc().removed_blobs == ()
    assert set(repo.gc(grace_seconds=0).removed_blobs) == set(a.blobs())


def test_deferred_delete_waits_for_last_lease(repo: SnapshotRepository):
    m = committed(repo, "a", alias="busy")
    assert repo.acquire("busy", "sbx-1") == m
    repo.acquire(m.id, "sbx-2")
    repo.acquire(m.id, "sbx-2")  # idempotent
    assert repo.holders("busy") == ["sbx-1", "sbx-2"]
    with pytest.raises(SnapshotInUse, match="in use by sbx-1, sbx-2"):
        repo.delete("busy", defer=False)
    assert repo.get("busy") == m
    assert repo.delete("busy") is False
    # hidden at once, alias freed for a new snapshot
    with pytest.raises(SnapshotNotFound):
        repo.get(m.id)
    assert repo.list() == []
    with pytest.raises(SnapshotNotFound):
        repo.acquire(m.id, "sbx-3")
    successor = committed(repo, "b", alias="busy")
    # its blobs survive gc while leased
    assert set(repo.gc().removed_blobs).isdisjoint(m.blobs())
    assert all(repo.has_blob(d) for d in m.blobs())
    repo.release(m.id, "sbx-1")
    assert (repo.root / "manifests" / f"{m.id}.json").exists()
    assert repo.holders(m.id) == ["sbx-2"]
    repo.release(m.id, "sbx-2")
    assert not (repo.root / "manifests" / f"{m.id}.json").exists()
    assert not (repo.root / "deleted" / m.id).exists()
    assert not (repo.root / "leases" / m.id).exists()
    assert not any(repo.has_blob(d) for d in m.blobs())
    assert repo.resolve("busy") == successor.id
    repo.release(m.id, "sbx-2")  # releasing again is harmless


def test_release_without_delete_keeps_snapshot(repo: SnapshotRepository):
    m = committed(repo, "a")
    repo.acquire(m.id, "sbx-1")
    repo.release(m.id, "sbx-1")
    assert repo.get(m.id) == m
    assert not (repo.root / "leases" / m.id).exists()
    assert repo.delete(m.id, defer=False) is True


def test_leases_and_deferred_deletes_survive_restart(repo: SnapshotRepository):
    m = committed(repo, "a")
    repo.acquire(m.id, "sbx-1")
    repo.delete(m.id)
    restarted = SnapshotRepository(repo.root, grace_seconds=0)
    assert restarted.holders(m.id) == ["sbx-1"]
    restarted.gc()
    assert all(restarted.has_blob(d) for d in m.blobs())
    with pytest.raises(SnapshotNotFound):
        restarted.get(m.id)
    restarted.release(m.id, "sbx-1")
    assert not any(restarted.has_blob(d) for d in m.blobs())


def test_lease_survives_restart_and_blocks_delete(repo: SnapshotRepository):
    m = committed(repo, "a")
    repo.acquire(m.id, "sbx-7")
    restarted = SnapshotRepository(repo.root)
    with pytest.raises(SnapshotInUse, match="sbx-7"):
        restarted.delete(m.id, defer=False)


def test_invalid_lease_holders(repo: SnapshotRepository):
    m = committed(repo, "a")
    for bad in ("", "../x", "a/b", ".hidden"):
        with pytest.raises(InvalidName):
            repo.acquire(m.id, bad)


def test_gc_finishes_deferred_delete_interrupted_by_crash(repo: SnapshotRepository):
    m = committed(repo, "a")
    repo.acquire(m.id, "sbx-1")
    repo.delete(m.id)
    (repo.root / "leases" / m.id / "sbx-1").unlink()  # crash after dropping the last lease
    report = repo.gc()
    assert set(report.removed_blobs) >= set(m.blobs())
    assert not (repo.root / "manifests" / f"{m.id}.json").exists()
    assert not (repo.root / "deleted" / m.id).exists()


# ---- garbage collection --------------------------------------------------------------------------


def test_gc_removes_only_unreferenced_blobs(repo: SnapshotRepository, tmp_path: Path):
    kept = committed(repo, "kept")
    orphan = repo.put_bytes(b"orphan" * 1000)
    big = tmp_path / "big"
    big.write_bytes(os.urandom(64 * 1024))
    big_digest = repo.put_blob(big, move=True)
    report = repo.gc()
    assert sorted(report.removed_blobs) == sorted([orphan, big_digest])
    assert report.freed_bytes >= 64 * 1024
    assert all(repo.has_blob(d) for d in kept.blobs())
    assert repo.gc().removed_blobs == ()


def test_gc_grace_protects_blobs_awaiting_commit(tmp_path: Path):
    repo = SnapshotRepository(tmp_path / "repo", grace_seconds=3600)
    m = make_snapshot(repo, "pending")
    assert repo.gc().removed_blobs == ()
    repo.commit(m)
    # re-storing an old blob refreshes it, so dedup against a stale blob is protected too
    path = repo.blob_path(m.memory_image)
    os.utime(path, (0, 0))
    repo.put_bytes(b"pending-mem")
    assert path.stat().st_mtime > time.time() - 60


def test_gc_removes_stale_staging_but_not_own_or_fresh(tmp_path: Path):
    repo = SnapshotRepository(tmp_path / "repo", grace_seconds=3600)
    mine = repo.staging_dir()
    (mine / "memory.img").write_bytes(b"x")
    other = SnapshotRepository(repo.root, grace_seconds=3600)
    foreign_fresh = other.staging_dir()
    foreign_stale = other.staging_dir()
    os.utime(foreign_stale, (0, 0))
    assert repo.gc().removed_staging == 1
    assert mine.exists() and foreign_fresh.exists() and not foreign_stale.exists()
    assert repo.cleanup_staging(older_than=0) == 1  # at startup, with no other users
    assert mine.exists() and not foreign_fresh.exists()
    repo.discard_staging(mine)
    assert not mine.exists()


def test_staging_is_on_the_repository_filesystem(repo: SnapshotRepository):
    staging = repo.staging_dir()
    image = write(staging / "memory.img", b"guest memory")
    digest = repo.put_blob(image)
    assert repo.blob_path(digest).stat().st_ino == image.stat().st_ino
    assert staging.stat().st_dev == repo.root.stat().st_dev


def test_gc_concurrent_with_commits(repo: SnapshotRepository):
    """Commits racing gc in threads: every committed snapshot keeps all its blobs."""
    grace_repo = SnapshotRepository(repo.root, grace_seconds=3600)
    stop = threading.Event()
    errors: list[BaseException] = []

    def collect():
        while not stop.is_set():
            try:
                grace_repo.gc()
            except BaseException as exc:
                errors.append(exc)

    collector = threading.Thread(target=collect)
    collector.start()
    try:
        made = [committed(grace_repo, f"c{i}") for i in range(30)]
    finally:
        stop.set()
        collector.join()
    assert errors == []
    for m in made:
        assert all(grace_repo.has_blob(d) for d in m.blobs())
    repo.gc()
    assert len(repo.list()) == 30
    assert all(repo.has_blob(d) for m in made for d in m.blobs())
