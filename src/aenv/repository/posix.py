"""The POSIX repository: content-addressed blobs plus a catalog of committed manifests.

This is the durable source of truth for templates and snapshots: the POSIX-directory
implementation of `aenv.repository.contract.Repository` (the directory may be local or on a
shared filesystem; `aenv.runtime.resolvers.LocalRuntime` uses its blobs in place). Layout under
``root``::

    blobs/sha256/<hex>        immutable blob files (mode 0444), named by the sha256 of their bytes
    manifests/<id>.json       committed manifests; a snapshot exists exactly when this file does
    aliases/<alias>           a file holding the id the alias points to
    leases/<id>/<holder>      one per holder (a sandbox id) using the snapshot; holds the node id
    nodes/<node>              the node's heartbeat: its mtime is when the node last said it is alive
    deleted/<id>              tombstone: deleted while leased, removed when the last lease goes
    claims/<id>               the node that took the snapshot over, written once (`claim`)
    staging/                  scratch directories and temporary blob copies (same filesystem)
    pending/                  captures answered but not committed yet (`aenv.snapshot.pending`)
    marks/<id or alias>       a snapshot its node answered and commits in the background
    lock                      flock()ed by every catalog change and by gc

Crash safety: every catalog file is written to a dot-named temporary in its own directory,
fsynced, renamed into place and the directory fsynced, so a reader sees the old state or the
new, never a partial file. ``commit`` binds the alias first and writes the manifest last: a crash
in between leaves an alias pointing at no manifest, which counts as unbound and is removed by
``gc``. Blobs without a manifest are garbage, not snapshots.

A blob is stored before the manifest that names it is committed, so ``gc`` and ``delete`` leave
alone any unreferenced blob touched within ``grace_seconds`` (storing a blob, even one already
present, refreshes its mtime). Blob files are shared by hardlink with the file they were stored
from: callers must treat a stored file as immutable from then on.

Leases expire with their node: every lease names the node that took it, and a node whose
heartbeat (`heartbeat`, called by the node's `runtime.open.Heartbeat` thread) is older than
``lease_ttl`` is dead to the others, so its leases no longer defer deletions or protect blobs.
A node's own leases are always live to itself (a restarted node takes its leases back), and a
lease written before leases named their node never expires.

The rules over these records (alias resolution, lease liveness, gc's selection, claims, pending
marks) are `aenv.repository.catalog.Catalog`'s, shared with the s3 backend: this module gives
them their primitives over files, and keeps what a directory does its own way (blobs by
hardlink, commits and lease changes under the lock).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from .catalog import Catalog, NodeLive, manifest_key
from .contract import DEFAULT_LEASE_TTL, GcReport
from .errors import AliasConflict, DigestMismatch, MissingBlob, SnapshotExists, SnapshotInUse
from .files import check_fetched, file_digest, sparse_copy
from .manifest import SnapshotManifest
from .names import HOLDER_RE, check_alias, check_digest, check_holder, check_snapshot_id, default_node_id
from .staging import Staging


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that readers and crashes see all of it or none of it."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _unlink_durably(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    _fsync_dir(path.parent)
    return True


class SnapshotRepository(Catalog):
    """Committed snapshots and their blobs in one directory; safe for threads and processes."""

    MARKS = "marks"
    shared = False  # its blobs are this node's files, used in place

    def __init__(
        self,
        root: Path | str,
        *,
        grace_seconds: float = 3600.0,
        node: str | None = None,
        lease_ttl: float | None = DEFAULT_LEASE_TTL,
    ) -> None:
        self.root = Path(root)
        self.grace_seconds = grace_seconds
        self.node = check_holder(node or default_node_id())
        self.lease_ttl = lease_ttl
        self._nodes = self.root / "nodes"
        self._blobs = self.root / "blobs" / "sha256"
        self._manifests = self.root / "manifests"
        self._aliases = self.root / "aliases"
        self._leases = self.root / "leases"
        self._deleted = self.root / "deleted"
        self._claims = self.root / "claims"
        self._marks = self.root / self.MARKS
        dirs = (self._blobs, self._manifests, self._aliases, self._leases, self._deleted)
        for d in (*dirs, self._nodes, self._claims, self._marks):
            d.mkdir(parents=True, exist_ok=True)
        self._staging = Staging(self.root / "staging")
        self._lock = threading.Lock()

    @property
    def local_root(self) -> Path:
        return self.root

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Exclusive against other threads (the Lock) and other processes (flock on ``lock``)."""
        with self._lock, open(self.root / "lock", "a") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            yield

    # ---- blobs -------------------------------------------------------------------------------

    def blob_path(self, digest: str) -> Path:
        """Where the blob with this digest lives (whether or not it is stored)."""
        return self._blobs / check_digest(digest).removeprefix("sha256:")

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    def verify_blob(self, digest: str) -> None:
        """Rehash a stored blob; raise ``MissingBlob`` or ``DigestMismatch`` if it is not intact."""
        path = self.blob_path(digest)
        try:
            actual = file_digest(path)
        except FileNotFoundError:
            raise MissingBlob(f"blob {digest} is not in the repository") from None
        if actual != digest:
            raise DigestMismatch(f"blob {digest} is corrupt: its contents hash to {actual}")

    def fetch_blob(self, digest: str, dest: Path) -> None:
        """Copy a blob to a new file ``dest`` (holes stay holes), verified against its digest."""
        try:
            sparse_copy(self.blob_path(digest), dest)
        except FileNotFoundError:
            raise MissingBlob(f"blob {digest} is not in the repository") from None
        check_fetched(dest, digest)

    def put_blob(
        self, path: Path | str, *, digest: str | None = None, move: bool = False, verify: bool = True
    ) -> str:
        """Store a file under the sha256 of its contents and return that digest.

        A digest the caller already knows is verified, unless `verify` is off because the caller
        computed it while writing the file itself (a memory capture). An existing blob with the
        same digest is reused (and the input removed when ``move``). On the same filesystem the
        file becomes the blob by hardlink (or rename when ``move``) in O(1); otherwise its data
        regions are copied so sparse memory images stay sparse.
        """
        src = Path(path)
        actual = file_digest(src) if verify or digest is None else check_digest(digest)
        if digest is not None and actual != check_digest(digest):
            raise DigestMismatch(f"{src} hashes to {actual}, not to the given {digest}")
        try:
            self._place(src, actual, move)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            with self._staging.temp_file() as tmp:
                sparse_copy(src, tmp)
                self._place(tmp, actual, move=True)
            if move:
                src.unlink()
        return actual

    def put_bytes(self, data: bytes) -> str:
        """Store a small blob (device state, vmstate prefix) and return its digest."""
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        with self._staging.temp_file() as tmp:
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            self._place(tmp, digest, move=True)
        return digest

    def _place(self, src: Path, digest: str, move: bool) -> None:
        """Make ``src`` the blob ``digest`` unless it exists; EXDEV propagates for the copy path.

        Holds the lock so a concurrent gc cannot remove a blob between the reuse decision and
        the mtime refresh that protects it until its manifest is committed.
        """
        final = self.blob_path(digest)
        with self._locked():
            if final.exists():
                os.utime(final)
                if move and not os.path.samefile(src, final):
                    src.unlink()
                return
            if move:
                os.rename(src, final)
            else:
                os.link(src, final)
            os.chmod(final, 0o444)
            os.utime(final)
            _fsync_dir(self._blobs)

    # ---- staging -----------------------------------------------------------------------------

    def staging_dir(self) -> Path:
        """A fresh scratch directory on the repository's filesystem, so storing from it is O(1).

        Remove it with ``discard_staging`` when done; forgotten ones are removed by
        ``cleanup_staging``/``gc`` once older than the grace period.
        """
        return self._staging.new_dir()

    def pending_dir(self) -> Path:
        """Captures awaiting their commit: beside staging (so a blob is a rename), never cleaned by it."""
        return self.root / "pending"

    def discard_staging(self, path: Path) -> None:
        """Remove a directory made by ``staging_dir`` (blobs stored from it are unaffected)."""
        self._staging.discard(path)

    def cleanup_staging(self, older_than: float | None = None) -> int:
        """Remove staging entries not made by this instance and older than ``older_than`` seconds.

        The default is the grace period, which protects another process's work in progress on a
        shared repository; a node that is the repository's only user may pass 0 at startup.
        """
        return self._staging.cleanup(self.grace_seconds if older_than is None else older_than)

    # ---- catalog -----------------------------------------------------------------------------

    def commit(self, manifest: SnapshotManifest) -> None:
        """Publish a snapshot: all of it becomes visible at once, or nothing does.

        Refuses an id already committed, a manifest naming blobs not stored, and an alias bound
        to another live snapshot.
        """
        if manifest.alias is not None:
            check_alias(manifest.alias)
        with self._locked():
            path = self.root / manifest_key(manifest.id)
            if path.exists():
                raise SnapshotExists(f"snapshot {manifest.id!r} is already committed")
            missing = [d for d in manifest.blobs() if not self.has_blob(d)]
            if missing:
                raise MissingBlob(
                    f"snapshot {manifest.id!r} names blobs not in the repository: " + ", ".join(missing)
                )
            if manifest.alias is not None:
                self._bind_alias(manifest.alias, manifest.id)
            _write_atomic(path, manifest.to_json().encode())

    # ---- leases and deletion -----------------------------------------------------------------

    def acquire(self, id_or_alias: str, holder: str) -> SnapshotManifest:
        """Record that ``holder`` (a sandbox id) uses the snapshot, which pins it against deletion.

        Returns the manifest read under the lock, so it cannot vanish between lookup and lease.
        Acquiring again with the same holder is harmless.
        """
        check_holder(holder)
        with self._locked():
            manifest = self.get(id_or_alias)
            leases = self._leases / manifest.id
            leases.mkdir(exist_ok=True)
            _write_atomic(leases / holder, self.node.encode())
            _fsync_dir(self._leases)
        self.heartbeat()
        return manifest

    def transfer(self, snapshot_id: str, holder: str, to: str) -> None:
        """Hand ``holder``'s lease to ``to`` (a warm VM's to the sandbox it became): one rename,
        so the snapshot is pinned throughout, at a third of an acquire and a release's writes.
        Without a lease to hand on, ``to`` acquires one."""
        check_holder(holder)
        check_holder(to)
        check_snapshot_id(snapshot_id)
        leases = self._leases / snapshot_id
        with self._locked():
            try:
                os.replace(leases / holder, leases / to)
            except FileNotFoundError:
                pass
            else:
                _fsync_dir(leases)
                return
        self.acquire(snapshot_id, to)

    def release(self, snapshot_id: str, holder: str) -> None:
        """Drop ``holder``'s lease; the last release completes a deferred delete. Idempotent."""
        check_holder(holder)
        check_snapshot_id(snapshot_id)
        with self._locked():
            leases = self._leases / snapshot_id
            _unlink_durably(leases / holder)
            if not self._held(snapshot_id):
                with contextlib.suppress(OSError):  # gone, or expired leases of dead nodes left
                    leases.rmdir()
                if (self._deleted / snapshot_id).exists():
                    self._remove(snapshot_id, self.grace_seconds)

    def heartbeat(self) -> None:
        """Tell the other nodes sharing this repository that this node (and its leases) is alive."""
        (self._nodes / self.node).touch()

    def local_leases(self) -> set[str]:
        """Ids of the snapshots this node holds leases on (what its runtime cache must keep)."""
        found = set()
        for lease in self._leases.glob("*/[!.]*"):
            with contextlib.suppress(FileNotFoundError):
                if lease.read_text() in ("", self.node):
                    found.add(lease.parent.name)
        return found

    def delete(self, id_or_alias: str, *, defer: bool = True) -> bool:
        """Delete a snapshot; returns True if removed now, False if deferred until its leases end.

        A leased snapshot is hidden at once (its aliases freed) when ``defer``, else refused with
        ``SnapshotInUse``. Blobs still named by another manifest are never removed.
        """
        with self._locked():
            snapshot_id = self.resolve(id_or_alias)
            holders = self._holders(snapshot_id)
            if not holders:
                self._remove(snapshot_id, self.grace_seconds)
                return True
            if not defer:
                raise SnapshotInUse(f"snapshot {snapshot_id!r} is in use by {', '.join(holders)}")
            _write_atomic(self._deleted / snapshot_id, b"")
            self._drop_aliases(snapshot_id)
            return False

    # ---- garbage collection ------------------------------------------------------------------

    def gc(self, *, grace_seconds: float | None = None) -> GcReport:
        """Remove what no live or deferred-deleted manifest needs.

        That is: blobs no manifest names (unless touched within the grace period), debris of
        interrupted writes, dangling aliases, orphaned tombstones and leases, deferred deletes
        whose leases are all gone, and stale staging entries.
        """
        grace = self.grace_seconds if grace_seconds is None else grace_seconds
        with self._locked():
            # Every catalog write holds the lock, so any temporary seen now is crash debris.
            for d in (self._manifests, self._aliases, self._deleted, self._marks):
                for tmp in d.glob(".*.tmp"):
                    tmp.unlink(missing_ok=True)
            removed, freed, aliases = self._collect(grace)
            blobs, size = self._sweep_blobs(["sha256:" + p.name for p in self._blobs.iterdir()], grace)
            staging = self.cleanup_staging(grace)
        return GcReport(tuple(removed + blobs), freed + size, tuple(aliases), staging)

    # ---- the catalog's primitives (callers hold the lock where they change state) ---------------

    def _read(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            return None

    def _read_aged(self, key: str) -> tuple[bytes, float] | None:
        path = self.root / key
        try:
            return path.read_bytes(), time.time() - path.stat().st_mtime
        except FileNotFoundError:
            return None

    def _exists(self, key: str) -> bool:
        return (self.root / key).exists()

    def _write(self, key: str, data: bytes) -> None:
        _write_atomic(self.root / key, data)

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        """Under the lock (never called with it held): no conditional writes in a directory."""
        path = self.root / key
        with self._locked():
            if path.exists():
                return False
            _write_atomic(path, data)
            return True

    def _names(self, prefix: str) -> list[str]:
        return [p.name for p in (self.root / prefix).glob("[!.]*")]

    def _delete(self, key: str) -> None:
        _unlink_durably(self.root / key)

    def _delete_tree(self, prefix: str) -> None:
        shutil.rmtree(self.root / prefix, ignore_errors=True)

    def _guard(self) -> contextlib.AbstractContextManager[None]:
        return self._locked()

    def _node_liveness(self) -> NodeLive:
        return self._node_live

    def _node_live(self, node: str) -> bool:
        """Whether the node's heartbeat is within the lease ttl (this node always is)."""
        if node == self.node or self.lease_ttl is None:
            return True
        if not HOLDER_RE.fullmatch(node):
            return False
        try:
            beat = (self._nodes / node).stat().st_mtime
        except FileNotFoundError:
            return False
        return time.time() - beat <= self.lease_ttl

    def _drop_blob(self, digest: str, grace: float) -> int | None:
        path = self.blob_path(digest)
        try:
            st = path.stat()
            if st.st_mtime > time.time() - grace:
                return None
            path.unlink()
        except FileNotFoundError:
            return None
        return st.st_blocks * 512 if st.st_nlink == 1 else 0  # a hardlinked file frees nothing

    def _sweep_blobs(self, candidates: list[str], grace: float) -> tuple[list[str], int]:
        removed, freed = super()._sweep_blobs(candidates, grace)
        if removed:
            _fsync_dir(self._blobs)
        return removed, freed

    def _bind_alias(self, alias: str, snapshot_id: str) -> None:
        current = self._alias_target(alias)
        if current is not None and current != snapshot_id:
            raise AliasConflict(
                f"alias {alias!r} already points to {current!r}, cannot rebind to {snapshot_id!r}"
            )
        if current is None:
            _write_atomic(self._aliases / alias, snapshot_id.encode())
