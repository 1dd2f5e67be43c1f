"""The snapshot repository: content-addressed blobs plus a catalog of committed manifests.

This is the durable source of truth for templates and snapshots: the POSIX-directory
implementation of `aenv.storage.protocols.Repository` (the directory may be local or on a
shared filesystem; `aenv.storage.runtime.LocalRuntime` uses its blobs in place). Layout under
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
heartbeat (`heartbeat`, called by the node's `storage.Heartbeat` thread) is older than
``lease_ttl`` is dead to the others, so its leases no longer defer deletions or protect blobs.
A node's own leases are always live to itself (a restarted node takes its leases back), and a
lease written before leases named their node never expires.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from aenv.snapshot.manifest import (
    DIGEST_RE,
    SNAPSHOT_ID_RE,
    ManifestError,
    SnapshotManifest,
    parse_timestamp,
)

log = logging.getLogger(__name__)

CHUNK = 1 << 20
_ZERO_BYTES = bytes(CHUNK)
_ZEROS = memoryview(_ZERO_BYTES)
ALIAS_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
HOLDER_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
DIGEST_ANYWHERE = re.compile(r"sha256:[0-9a-f]{64}")
DEFAULT_LEASE_TTL = 600.0  # seconds a node may go without a heartbeat before its leases expire


def default_node_id() -> str:
    """This host's name as a lease owner, for repositories used by one node per host."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64] or "local"


class RepositoryError(Exception):
    """Base of every error the snapshot repository raises."""


class InvalidName(RepositoryError, ValueError):
    """An alias, snapshot id or lease holder does not follow the naming rules."""


class InvalidDigest(RepositoryError, ValueError):
    """A blob digest is not of the form ``sha256:<64 lowercase hex>``."""


class SnapshotNotFound(RepositoryError, LookupError):
    """No live snapshot has this id or alias."""


class SnapshotExists(RepositoryError):
    """A manifest with this id was already committed."""


class AliasConflict(RepositoryError):
    """The alias is bound to another live snapshot."""


class MissingBlob(RepositoryError):
    """A manifest names blobs the repository does not hold."""


class DigestMismatch(RepositoryError):
    """Bytes do not hash to the digest they were given or stored under."""


class SnapshotInUse(RepositoryError):
    """The snapshot is leased and the caller asked not to defer its deletion."""


class CorruptManifest(RepositoryError):
    """A stored manifest cannot be read (damaged, or written by a newer aenv)."""


@dataclass(frozen=True)
class GcReport:
    """What one garbage collection pass removed."""

    removed_blobs: tuple[str, ...] = ()
    freed_bytes: int = 0
    removed_aliases: tuple[str, ...] = ()
    removed_staging: int = 0


@dataclass(frozen=True)
class PendingMark:
    """A snapshot a node answered and commits in the background (`aenv.snapshot.pending`), as
    the other nodes sharing the repository see it until the commit ends."""

    snapshot_id: str
    node: str  # the node committing it
    failure: str | None  # why its commit failed (the mark then stays until it is stale)
    stale: bool  # its node is gone, or it is older than the grace period: no commit will come

    def to_json(self) -> bytes:
        return json.dumps({"id": self.snapshot_id, "node": self.node, "failure": self.failure}).encode()

    @classmethod
    def parse(cls, data: bytes, *, age: float, node_live: Callable[[str], bool], grace: float) -> PendingMark:
        fields = json.loads(data)
        node = str(fields["node"])
        stale = age > grace or not node_live(node)
        return cls(str(fields["id"]), node, fields.get("failure"), stale)


def mark_names(snapshot_id: str, alias: str | None) -> list[str]:
    """The names a pending mark is found by: the snapshot's id and its alias."""
    return [name for name in (snapshot_id, alias) if name]


def data_extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each data region of an open file; holes in between read as zeros.

    Filesystems without hole tracking report the whole file as data, which is still correct.
    """
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole is left
                return
            if exc.errno != errno.EINVAL:
                raise
            yield pos, size  # SEEK_DATA unsupported here
            return
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        yield start, end
        pos = end


def _read_range(fd: int, start: int, end: int, buf: bytearray) -> Iterator[memoryview]:
    view = memoryview(buf)
    pos = start
    while pos < end:
        n = os.preadv(fd, [view[: min(CHUNK, end - pos)]], pos)
        if n == 0:
            return  # truncated under us; the caller's length check reports it
        yield view[:n]
        pos += n


def file_digest(path: Path) -> str:
    """sha256 of a file's full contents, reading only its data regions (holes hash as zeros)."""
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        pos = 0
        for start, end in data_extents(f.fileno(), size):
            _hash_zeros(h, start - pos)
            pos = start
            for chunk in _read_range(f.fileno(), start, end, buf):
                h.update(chunk)
                pos += len(chunk)
        _hash_zeros(h, size - pos)
    return "sha256:" + h.hexdigest()


def _hash_zeros(h: hashlib._Hash, count: int) -> None:
    while count > 0:
        n = min(count, CHUNK)
        h.update(_ZEROS[:n])
        count -= n


def sparse_copy(src: Path, dst: Path) -> None:
    """Copy ``src`` to a new file ``dst`` writing only non-zero data, so holes stay holes."""
    buf = bytearray(CHUNK)
    with open(src, "rb", buffering=0) as fin, open(dst, "xb", buffering=0) as fout:
        size = os.fstat(fin.fileno()).st_size
        for start, end in data_extents(fin.fileno(), size):
            pos = start
            for chunk in _read_range(fin.fileno(), start, end, buf):
                # bytes == bytes is a memcmp; comparing memoryviews is ~60x slower
                if chunk.tobytes() != _ZERO_BYTES[: len(chunk)]:
                    os.pwrite(fout.fileno(), chunk, pos)
                pos += len(chunk)
        os.ftruncate(fout.fileno(), size)
        os.fsync(fout.fileno())


def check_fetched(path: Path, digest: str) -> None:
    """Remove ``path`` and raise ``DigestMismatch`` unless its bytes hash to ``digest``."""
    actual = file_digest(path)
    if actual != digest:
        path.unlink(missing_ok=True)
        raise DigestMismatch(f"blob {digest} is corrupt: its contents hash to {actual}")


def write_fetched(dest: Path, chunks: Iterable[bytes], digest: str) -> None:
    """Write a downloaded blob to the new file `dest`, zero chunks left as holes, and check it.

    Whatever the source (the object store, a peer), `dest` is removed unless its bytes hash to
    `digest`, so a caller keeps only verified blobs.
    """
    try:
        with open(dest, "xb", buffering=0) as f:
            pos = 0
            for chunk in chunks:
                if chunk != _ZERO_BYTES[: len(chunk)]:
                    os.pwrite(f.fileno(), chunk, pos)
                pos += len(chunk)
            os.ftruncate(f.fileno(), pos)
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    check_fetched(dest, digest)


def catalog(
    snapshot_ids: Iterable[str],
    load: Callable[[str], SnapshotManifest],
    aliases: dict[str, list[str]],
    kind: str | None,
) -> list[SnapshotManifest]:
    """What `list` shows of these live snapshots, whichever backend holds them: newest first (ties by
    id), each with the alias bound to it; one deleted meanwhile or unreadable is skipped (logged)."""
    found = []
    for snapshot_id in snapshot_ids:
        try:
            manifest = load(snapshot_id)
        except SnapshotNotFound:
            continue  # deleted while listing
        except CorruptManifest as exc:
            log.warning("skipping snapshot %s: %s", snapshot_id, exc)
            continue
        if kind is None or manifest.kind == kind:
            bound = aliases.get(snapshot_id, [])
            alias = manifest.alias if manifest.alias in bound else (bound[0] if bound else None)
            found.append(dataclasses.replace(manifest, alias=alias))
    found.sort(key=lambda m: m.id)
    found.sort(key=lambda m: parse_timestamp(m.created_at), reverse=True)
    return found


def check_alias(alias: str) -> str:
    """Return ``alias`` if it is a valid alias name, else raise ``InvalidName``."""
    if not isinstance(alias, str) or not ALIAS_RE.fullmatch(alias):
        raise InvalidName(
            f"invalid alias {alias!r}: use 1-63 characters of a-z, 0-9, '.', '_', '-', "
            "starting with a letter or digit"
        )
    return alias


def check_digest(digest: str) -> str:
    if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
        raise InvalidDigest(f"invalid digest {digest!r}: expected 'sha256:<64 lowercase hex>'")
    return digest


def check_holder(holder: str) -> str:
    if not isinstance(holder, str) or not HOLDER_RE.fullmatch(holder):
        raise InvalidName(f"invalid lease holder {holder!r}: use letters, digits, '.', '_', '-'")
    return holder


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


class SnapshotRepository:
    """Committed snapshots and their blobs in one directory; safe for threads and processes."""

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
        self._staging = self.root / "staging"
        self._claims = self.root / "claims"
        self._marks = self.root / "marks"
        dirs = (self._blobs, self._manifests, self._aliases, self._leases, self._deleted, self._staging)
        for d in (*dirs, self._nodes, self._claims, self._marks):
            d.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._own_staging: set[Path] = set()

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
            with self._temp_blob() as tmp:
                sparse_copy(src, tmp)
                self._place(tmp, actual, move=True)
            if move:
                src.unlink()
        return actual

    def put_bytes(self, data: bytes) -> str:
        """Store a small blob (device state, vmstate prefix) and return its digest."""
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        with self._temp_blob() as tmp:
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            self._place(tmp, digest, move=True)
        return digest

    @contextlib.contextmanager
    def _temp_blob(self) -> Iterator[Path]:
        """A temporary path in staging, protected from cleanup while in use and removed after."""
        tmp = self._staging / f".blob-{secrets.token_hex(8)}"
        self._own_staging.add(tmp)
        try:
            yield tmp
        finally:
            tmp.unlink(missing_ok=True)
            self._own_staging.discard(tmp)

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
        path = Path(tempfile.mkdtemp(prefix="s-", dir=self._staging))
        self._own_staging.add(path)
        return path

    def pending_dir(self) -> Path:
        """Captures awaiting their commit: beside staging (so a blob is a rename), never cleaned by it."""
        return self.root / "pending"

    def discard_staging(self, path: Path) -> None:
        """Remove a directory made by ``staging_dir`` (blobs stored from it are unaffected)."""
        self._own_staging.discard(Path(path))
        shutil.rmtree(path, ignore_errors=True)

    def cleanup_staging(self, older_than: float | None = None) -> int:
        """Remove staging entries not made by this instance and older than ``older_than`` seconds.

        The default is the grace period, which protects another process's work in progress on a
        shared repository; a node that is the repository's only user may pass 0 at startup.
        """
        cutoff = time.time() - (self.grace_seconds if older_than is None else older_than)
        removed = 0
        for own in [p for p in list(self._own_staging) if not p.exists()]:
            self._own_staging.discard(own)  # removed by its user without discard_staging
        for entry in self._staging.iterdir():
            if entry in self._own_staging:
                continue
            try:
                if entry.lstat().st_mtime > cutoff:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
            except FileNotFoundError:
                continue
            removed += 1
        return removed

    # ---- catalog -----------------------------------------------------------------------------

    def commit(self, manifest: SnapshotManifest) -> None:
        """Publish a snapshot: all of it becomes visible at once, or nothing does.

        Refuses an id already committed, a manifest naming blobs not stored, and an alias bound
        to another live snapshot.
        """
        if manifest.alias is not None:
            check_alias(manifest.alias)
        with self._locked():
            path = self._manifest_path(manifest.id)
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

    def resolve(self, id_or_alias: str) -> str:
        """The id of the live snapshot with this id or, failing that, this alias."""
        if isinstance(id_or_alias, str):
            if SNAPSHOT_ID_RE.fullmatch(id_or_alias) and self._is_live(id_or_alias):
                return id_or_alias
            if ALIAS_RE.fullmatch(id_or_alias):
                target = self._alias_target(id_or_alias)
                if target is not None:
                    return target
        raise SnapshotNotFound(f"snapshot or template {id_or_alias!r} not found")

    def get(self, id_or_alias: str) -> SnapshotManifest:
        """The manifest of a live snapshot, its ``alias`` set to the alias currently bound to it."""
        snapshot_id = self.resolve(id_or_alias)
        manifest = self._load(snapshot_id)
        if manifest.alias is not None and self._alias_target(manifest.alias) == snapshot_id:
            return manifest
        aliases = self._aliases_by_id().get(snapshot_id, [])
        return dataclasses.replace(manifest, alias=aliases[0] if aliases else None)

    def list(self, kind: str | None = None) -> list[SnapshotManifest]:
        """Live snapshots, newest first (ties by id); unreadable manifests are logged and skipped."""
        ids = (path.name.removesuffix(".json") for path in self._manifests.glob("[!.]*.json"))
        live = [i for i in ids if not (self._deleted / i).exists()]
        return catalog(live, self._load, self._aliases_by_id(), kind)

    def set_alias(self, alias: str, id_or_alias: str) -> None:
        """Bind ``alias`` to a live snapshot; ``AliasConflict`` if it is bound to another one."""
        check_alias(alias)
        with self._locked():
            self._bind_alias(alias, self.resolve(id_or_alias))

    def remove_alias(self, alias: str) -> None:
        """Unbind ``alias`` (the snapshot stays); ``SnapshotNotFound`` if it is not bound."""
        check_alias(alias)
        with self._locked():
            if self._alias_target(alias) is None:
                raise SnapshotNotFound(f"alias {alias!r} not found")
            _unlink_durably(self._aliases / alias)

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
        if not SNAPSHOT_ID_RE.fullmatch(snapshot_id):
            raise InvalidName(f"invalid snapshot id {snapshot_id!r}")
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
        if not SNAPSHOT_ID_RE.fullmatch(snapshot_id):
            raise InvalidName(f"invalid snapshot id {snapshot_id!r}")
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

    def is_live(self, snapshot_id: str) -> bool:
        """Whether a snapshot with this id is committed and not deleted."""
        return bool(SNAPSHOT_ID_RE.fullmatch(snapshot_id)) and self._is_live(snapshot_id)

    def leased(self, snapshot_id: str, holder: str) -> SnapshotManifest:
        """The manifest a lease holder runs from, also after a deferred delete hid it from `get`."""
        check_holder(holder)
        if not SNAPSHOT_ID_RE.fullmatch(snapshot_id) or not (self._leases / snapshot_id / holder).exists():
            raise SnapshotNotFound(f"{holder!r} holds no lease on snapshot {snapshot_id!r}")
        return self._load(snapshot_id)

    def holders(self, id_or_alias: str) -> list[str]:
        """Sorted lease holders of a snapshot (a deferred-deleted one too, given its id)."""
        if (
            isinstance(id_or_alias, str)
            and SNAPSHOT_ID_RE.fullmatch(id_or_alias)
            and self._manifest_path(id_or_alias).exists()
        ):
            return self._holders(id_or_alias)
        return self._holders(self.resolve(id_or_alias))

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

    # ---- claims (a hand-over that happens once) ------------------------------------------------

    def claim(self, snapshot_id: str) -> str:
        """Take the snapshot over for this node, once and for all: the first claim wins.

        Returns the node holding the claim (this one, unless another node claimed it first).
        """
        path = self._claims / self._check_id(snapshot_id)
        with self._locked():
            if not path.exists():
                _write_atomic(path, self.node.encode())
            return path.read_text()

    def claimant(self, snapshot_id: str) -> str | None:
        """The node that claimed the snapshot, if any."""
        try:
            return (self._claims / self._check_id(snapshot_id)).read_text()
        except FileNotFoundError:
            return None

    def unclaim(self, snapshot_id: str) -> None:
        """Give up this node's claim (a take-over that failed before it used the snapshot)."""
        with self._locked():
            if self.claimant(snapshot_id) == self.node:
                _unlink_durably(self._claims / snapshot_id)

    # ---- pending marks (snapshots answered, committed in the background) --------------------------

    def mark_pending(self, snapshot_id: str, alias: str | None = None, failure: str | None = None) -> None:
        """Tell the other nodes this node commits the snapshot (or that its commit failed)."""
        mark = PendingMark(self._check_id(snapshot_id), self.node, failure, stale=False).to_json()
        for name in mark_names(snapshot_id, alias):
            _write_atomic(self._marks / name, mark)

    def unmark_pending(self, snapshot_id: str, alias: str | None = None) -> None:
        for name in mark_names(snapshot_id, alias):
            _unlink_durably(self._marks / name)

    def pending_mark(self, id_or_alias: str) -> PendingMark | None:
        """The mark of a snapshot another node is committing, by id or alias (None: none)."""
        if not (SNAPSHOT_ID_RE.fullmatch(id_or_alias) or ALIAS_RE.fullmatch(id_or_alias)):
            return None
        path = self._marks / id_or_alias
        try:
            data, age = path.read_bytes(), time.time() - path.stat().st_mtime
        except FileNotFoundError:
            return None
        return PendingMark.parse(data, age=age, node_live=self._node_live, grace=self.grace_seconds)

    @staticmethod
    def _check_id(snapshot_id: str) -> str:
        if not isinstance(snapshot_id, str) or not SNAPSHOT_ID_RE.fullmatch(snapshot_id):
            raise InvalidName(f"invalid snapshot id {snapshot_id!r}")
        return snapshot_id

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
            removed, freed = [], 0
            for lease in self._leases.glob("*/[!.]*"):
                if not self._lease_live(lease):
                    lease.unlink(missing_ok=True)
            for tombstone in self._deleted.iterdir():
                if not self._manifest_path(tombstone.name).exists():
                    tombstone.unlink()
                elif not self._held(tombstone.name):
                    blobs, size = self._remove(tombstone.name, grace)
                    removed += blobs
                    freed += size
            for leases in self._leases.iterdir():
                if not self._manifest_path(leases.name).exists():
                    shutil.rmtree(leases)
            for claim in self._claims.glob("[!.]*"):
                if not self._manifest_path(claim.name).exists():
                    claim.unlink()
            for mark in self._marks.glob("[!.]*"):
                if (found := self.pending_mark(mark.name)) is not None and found.stale:
                    mark.unlink(missing_ok=True)
            removed_aliases = []
            for alias in self._aliases.glob("[!.]*"):
                if self._alias_target(alias.name) is None:
                    alias.unlink()
                    removed_aliases.append(alias.name)
            blobs, size = self._sweep_blobs(None, grace)
            staging = self.cleanup_staging(grace)
        removed += blobs
        freed += size
        return GcReport(tuple(removed), freed, tuple(sorted(removed_aliases)), staging)

    # ---- internals (callers hold the lock where they change state) ----------------------------

    def _manifest_path(self, snapshot_id: str) -> Path:
        return self._manifests / f"{snapshot_id}.json"

    def _is_live(self, snapshot_id: str) -> bool:
        return self._manifest_path(snapshot_id).exists() and not (self._deleted / snapshot_id).exists()

    def _load(self, snapshot_id: str) -> SnapshotManifest:
        try:
            text = self._manifest_path(snapshot_id).read_bytes()
        except FileNotFoundError:
            raise SnapshotNotFound(f"snapshot or template {snapshot_id!r} not found") from None
        try:
            return SnapshotManifest.from_json(text)
        except ManifestError as exc:
            raise CorruptManifest(f"manifest of snapshot {snapshot_id!r} is unreadable: {exc}") from exc

    def _alias_target(self, alias: str) -> str | None:
        """The live snapshot id ``alias`` points to, or None if unbound or dangling."""
        try:
            target = (self._aliases / alias).read_text().strip()
        except FileNotFoundError:
            return None
        return target if SNAPSHOT_ID_RE.fullmatch(target) and self._is_live(target) else None

    def _aliases_by_id(self) -> dict[str, list[str]]:
        by_id: dict[str, list[str]] = {}
        for path in sorted(self._aliases.glob("[!.]*")):
            target = self._alias_target(path.name)
            if target is not None:
                by_id.setdefault(target, []).append(path.name)
        return by_id

    def _bind_alias(self, alias: str, snapshot_id: str) -> None:
        current = self._alias_target(alias)
        if current is not None and current != snapshot_id:
            raise AliasConflict(
                f"alias {alias!r} already points to {current!r}, cannot rebind to {snapshot_id!r}"
            )
        if current is None:
            _write_atomic(self._aliases / alias, snapshot_id.encode())

    def _drop_aliases(self, snapshot_id: str) -> None:
        for path in self._aliases.glob("[!.]*"):
            with contextlib.suppress(FileNotFoundError):
                if path.read_text().strip() == snapshot_id:
                    _unlink_durably(path)

    def _holders(self, snapshot_id: str) -> list[str]:
        """Holders of live leases (those of dead nodes have expired)."""
        try:
            leases = list((self._leases / snapshot_id).glob("[!.]*"))
        except FileNotFoundError:
            return []
        return sorted(p.name for p in leases if self._lease_live(p))

    def _held(self, snapshot_id: str) -> bool:
        """Whether a live lease holds the snapshot. It stops at the first one found: a template's
        leases are its sandboxes, and every create from the warm pool releases one: with 200
        leases, reading them all took 2.8 ms of the release, and this takes 0.1 ms."""
        try:
            return any(self._lease_live(lease) for lease in (self._leases / snapshot_id).glob("[!.]*"))
        except FileNotFoundError:
            return False

    def _lease_live(self, lease: Path) -> bool:
        try:
            node = lease.read_text()
        except FileNotFoundError:
            return False
        return node == "" or self._node_live(node)

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

    def _remove(self, snapshot_id: str, grace: float) -> tuple[list[str], int]:
        """Remove a snapshot for good, then the blobs only it used. Order keeps crashes harmless.

        Returns the removed blobs and the bytes freed.
        """
        try:
            blobs = self._load(snapshot_id).blobs()
        except CorruptManifest:
            blobs = None  # unknown contents: leave its blobs to gc's conservative scan
        self._drop_aliases(snapshot_id)
        _unlink_durably(self._manifest_path(snapshot_id))
        _unlink_durably(self._deleted / snapshot_id)
        _unlink_durably(self._claims / snapshot_id)
        shutil.rmtree(self._leases / snapshot_id, ignore_errors=True)
        return self._sweep_blobs(blobs, grace) if blobs else ([], 0)

    def _referenced(self) -> set[str]:
        """Every digest any manifest file mentions, found textually.

        Reading digests out of the raw JSON instead of parsing it keeps blobs of manifests this
        node cannot parse (damaged, or from a newer aenv) safe from collection.
        """
        found: set[str] = set()
        for path in self._manifests.glob("[!.]*.json"):
            with contextlib.suppress(FileNotFoundError):
                found.update(DIGEST_ANYWHERE.findall(path.read_text(errors="replace")))
        return found

    def _sweep_blobs(self, candidates: list[str] | None, grace: float) -> tuple[list[str], int]:
        """Unlink unreferenced blobs (all, or just ``candidates``) not touched within ``grace``."""
        referenced = self._referenced()
        cutoff = time.time() - grace
        names = (
            [d.removeprefix("sha256:") for d in candidates]
            if candidates is not None
            else [p.name for p in self._blobs.iterdir()]
        )
        removed, freed = [], 0
        for name in sorted(names):
            digest = "sha256:" + name
            if digest in referenced or not DIGEST_RE.fullmatch(digest):
                continue
            path = self._blobs / name
            try:
                st = path.stat()
                if st.st_mtime > cutoff:
                    continue
                path.unlink()
            except FileNotFoundError:
                continue
            removed.append(digest)
            if st.st_nlink == 1:
                freed += st.st_blocks * 512
        if removed:
            _fsync_dir(self._blobs)
        return removed, freed
