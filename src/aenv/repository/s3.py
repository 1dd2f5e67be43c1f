"""The repository on any S3-compatible object store (`Repository`, the `s3` backend).

Same guarantees as the POSIX repository (`aenv.repository.posix`), obtained from object-store
primitives instead of a lock file, so that several nodes can share one bucket. Keys under
``prefix``::

    blobs/sha256/<hex>        immutable blobs, named by the sha256 of their bytes
    manifests/<id>.json       committed manifests; a snapshot exists exactly when this object does
    aliases/<alias>           the id the alias points to
    leases/<id>/<holder>      one per holder using the snapshot; holds the id of the holder's node
    nodes/<node>              the node's heartbeat: its LastModified is when it last said it lives
    deleted/<id>              tombstone: deleted while leased, removed when the last lease goes
    claims/<id>               the node that took the snapshot over (``If-None-Match: *``: once)
    pending/<id or alias>     a snapshot its node answered and commits in the background

- Blobs are verified twice: the store checks each upload (``ChecksumSHA256`` of a single PUT is
  the blob's own digest; each multipart part carries its ``Content-MD5``) and every read rehashes
  the bytes. A blob becomes visible only when its upload completes, so an interrupted upload
  leaves nothing behind but an unfinished multipart upload, which ``gc`` aborts after the grace
  period.
- One winner: a manifest is written with ``If-None-Match: *`` (a second commit of the same id
  gets 412); an alias is created the same way and replaced only with ``If-Match`` on the ETag of
  the dangling binding it read. A manifest is committed before its alias, and withdrawn if the
  alias belongs to another live snapshot.
- Leases expire with their node: a lease names its node, and a node whose heartbeat object is
  older than ``lease_ttl`` (by the store's clock, from the ``Date`` of the listing) is dead to
  the others. ``acquire`` writes the lease before it checks the snapshot is live and
  ``delete`` writes the tombstone before it counts leases, so between two nodes either the
  delete sees the lease (and defers) or the acquire sees the tombstone (and fails).
- gc across nodes: storing a blob that already exists refreshes its LastModified (a copy onto
  itself), gc lists blobs before manifests, skips blobs younger than the grace period and reads
  each candidate's LastModified again right before deleting it. A commit must therefore follow
  the storing of its blobs within the grace period (an hour by default).

Staging (the builder tier) is a local directory: captures are written there and uploaded. The
rules over the catalog's records are `aenv.repository.catalog.Catalog`'s, shared with the posix
backend: this module gives them their primitives over objects.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

from .catalog import Catalog, NodeLive, manifest_key
from .chunks import CHUNK_SIZE, ChunkIndex
from .contract import DEFAULT_LEASE_TTL, GcReport
from .errors import (
    AliasConflict,
    DigestMismatch,
    MissingBlob,
    RepositoryError,
    SnapshotExists,
    SnapshotInUse,
    SnapshotNotFound,
)
from .files import CHUNK, file_digest, write_fetched
from .location import S3Location
from .manifest import SnapshotManifest
from .names import HOLDER_RE, SNAPSHOT_ID_RE, check_alias, check_digest, check_holder, check_snapshot_id
from .s3objects import NOT_FOUND, PRECONDITION_FAILED, BlobReader, error_code
from .staging import Staging

log = logging.getLogger(__name__)

MIB = 1 << 20
MIN_PART = 5 * MIB  # S3's smallest part (all but the last)
LAZY_MIN = 32 * CHUNK_SIZE  # blobs this large get a chunk index: they may be loaded on demand


class S3Repository(Catalog):
    """Committed snapshots and their blobs in an S3 bucket; safe for threads and for many nodes."""

    MARKS = "pending"
    shared = True  # other nodes use the bucket; this node holds copies of its blobs

    def __init__(
        self,
        location: S3Location,
        staging: Path,
        *,
        node: str,
        grace_seconds: float = 3600.0,
        lease_ttl: float | None = DEFAULT_LEASE_TTL,
        part_size: int = 64 * MIB,
        create_bucket: bool = False,
    ) -> None:
        if part_size < MIN_PART:
            raise ValueError(f"part_size must be at least {MIN_PART} bytes")
        self.location = location
        self.node = check_holder(node)
        self.grace_seconds = grace_seconds
        self.lease_ttl = lease_ttl
        self.part_size = part_size
        self._bucket = location.bucket
        self._prefix = f"{location.prefix}/" if location.prefix else ""
        self.reader = BlobReader(location)
        self._client = self.reader.client
        if create_bucket:
            self._create_bucket()
        self._staging = Staging(staging)
        self._leases_lock = threading.Lock()
        self._mine: set[tuple[str, str]] | None = None  # (snapshot, holder) leased by this node
        self._last_beat = 0.0

    @property
    def local_root(self) -> Path:
        return self._staging.root

    # ---- object helpers ------------------------------------------------------------------------

    def _key(self, *parts: str) -> str:
        return self._prefix + "/".join(parts)

    def _blob_key(self, digest: str) -> str:
        return self._key("blobs", "sha256", check_digest(digest).removeprefix("sha256:"))

    def _create_bucket(self) -> None:
        try:
            self._client.create_bucket(Bucket=self._bucket)
        except ClientError as exc:
            if error_code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    def _head(self, key: str) -> dict[str, Any] | None:
        return self._unless_absent(self._client.head_object, key)

    def _get(self, key: str) -> dict[str, Any] | None:
        return self._unless_absent(self._client.get_object, key)

    def _unless_absent(self, call: Callable[..., dict[str, Any]], key: str) -> dict[str, Any] | None:
        """The answer of a HEAD or GET of the object, or None if there is no such object."""
        try:
            return call(Bucket=self._bucket, Key=key)
        except ClientError as exc:
            if error_code(exc) in NOT_FOUND:
                return None
            raise

    def _put(self, key: str, data: bytes, **conditions: str) -> dict[str, Any]:
        md5 = base64.b64encode(hashlib.md5(data).digest()).decode()
        return self._client.put_object(Bucket=self._bucket, Key=key, Body=data, ContentMD5=md5, **conditions)

    def _list(self, *parts: str) -> tuple[list[dict[str, Any]], datetime]:
        """Objects under a key prefix, and the store's clock when it listed them."""
        prefix = self._key(*parts)
        found: list[dict[str, Any]] = []
        now = datetime.now(UTC)
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self._bucket, Prefix=prefix)
        for page in pages:
            found.extend(page.get("Contents", []))
            date = page["ResponseMetadata"]["HTTPHeaders"].get("date")
            if date:
                now = parsedate_to_datetime(date)
        for entry in found:
            entry["Name"] = entry["Key"][len(prefix) :]
        return found, now

    # ---- blobs ---------------------------------------------------------------------------------

    def has_blob(self, digest: str) -> bool:
        return self._head(self._blob_key(digest)) is not None

    def verify_blob(self, digest: str) -> None:
        """Rehash a stored blob; raise ``MissingBlob`` or ``DigestMismatch`` if it is not intact."""
        h = hashlib.sha256()
        for chunk in self._stream(digest):
            h.update(chunk)
        actual = "sha256:" + h.hexdigest()
        if actual != digest:
            raise DigestMismatch(f"blob {digest} is corrupt: its contents hash to {actual}")

    def fetch_blob(self, digest: str, dest: Path) -> None:
        """Download a blob to the new file ``dest``, writing no zero chunks (holes stay holes)."""
        write_fetched(dest, self._stream(digest), digest)

    def _stream(self, digest: str) -> Iterator[bytes]:
        answer = self._get(self._blob_key(digest))
        if answer is None:
            raise MissingBlob(f"blob {digest} is not in the repository")
        with contextlib.closing(answer["Body"]) as body:
            yield from body.iter_chunks(CHUNK)

    def put_blob(
        self, path: Path | str, *, digest: str | None = None, move: bool = False, verify: bool = True
    ) -> str:
        """Upload a file under the sha256 of its contents and return that digest.

        A digest the caller already knows is verified unless `verify` is off (the store checks
        it anyway for a single-request upload). A blob already stored is not uploaded again.
        """
        src = Path(path)
        actual = file_digest(src) if verify or digest is None else check_digest(digest)
        if digest is not None and actual != check_digest(digest):
            raise DigestMismatch(f"{src} hashes to {actual}, not to the given {digest}")
        if not self._refresh(actual):
            size = src.stat().st_size
            index = ChunkIndex.build(src) if size >= LAZY_MIN else None
            if size <= self.part_size:
                self._upload_single(src.read_bytes(), actual)
            else:
                self._upload_multipart(src, actual, size)
            if index is not None:  # after the blob: a blob without its index is loaded whole
                self._put(self.reader.key("chunks", actual), index.to_json())
        if move:
            src.unlink()
        return actual

    def put_bytes(self, data: bytes) -> str:
        """Store a small blob (device state, vmstate prefix) and return its digest."""
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if not self._refresh(digest):
            self._upload_single(data, digest)
        return digest

    def _refresh(self, digest: str) -> bool:
        """Make an existing blob young again (so gc spares it until its manifest is committed).

        Returns False if the blob is not stored.
        """
        key = self._blob_key(digest)
        if self._head(key) is None:
            return False
        try:
            self._client.copy_object(
                Bucket=self._bucket, Key=key, CopySource={"Bucket": self._bucket, "Key": key},
                MetadataDirective="REPLACE", Metadata={"refreshed": str(time.time())},
            )  # fmt: skip
        except ClientError as exc:
            if error_code(exc) in NOT_FOUND:
                return False  # collected in between: upload it again
            raise
        return True

    def _upload_single(self, data: bytes, digest: str) -> None:
        checksum = base64.b64encode(bytes.fromhex(digest.removeprefix("sha256:"))).decode()
        try:
            self._client.put_object(
                Bucket=self._bucket, Key=self._blob_key(digest), Body=data, ChecksumSHA256=checksum
            )
        except ClientError as exc:
            if error_code(exc) in ("BadDigest", "XAmzContentSHA256Mismatch", "InvalidDigest"):
                raise DigestMismatch(f"the store received bytes that do not hash to {digest}") from exc
            raise

    def _upload_multipart(self, src: Path, digest: str, size: int) -> None:
        """Parts of `part_size` with their MD5 checked by the store; aborted on any failure.

        The finished object is read back and rehashed only by readers: a part the store got
        intact that came from a file changed meanwhile is caught by the digest check on read.
        """
        key = self._blob_key(digest)
        upload = self._client.create_multipart_upload(Bucket=self._bucket, Key=key)["UploadId"]
        try:
            parts = []
            with open(src, "rb") as f:
                for number, offset in enumerate(range(0, size, self.part_size), start=1):
                    data = f.read(min(self.part_size, size - offset))
                    md5 = base64.b64encode(hashlib.md5(data).digest()).decode()
                    answer = self._client.upload_part(
                        Bucket=self._bucket, Key=key, UploadId=upload, PartNumber=number, Body=data,
                        ContentMD5=md5,
                    )  # fmt: skip
                    parts.append({"PartNumber": number, "ETag": answer["ETag"]})
            self._client.complete_multipart_upload(
                Bucket=self._bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            with contextlib.suppress(Exception):
                self._client.abort_multipart_upload(Bucket=self._bucket, Key=key, UploadId=upload)
            raise

    # ---- staging -------------------------------------------------------------------------------

    def staging_dir(self) -> Path:
        """A fresh local scratch directory; what is stored from it is uploaded."""
        return self._staging.new_dir()

    def pending_dir(self) -> Path:
        """Captures awaiting their commit (upload): a local directory beside staging."""
        return self._staging.root.parent / "pending"

    def discard_staging(self, path: Path) -> None:
        self._staging.discard(path)

    def cleanup_staging(self, older_than: float | None = None) -> int:
        """Remove local staging entries not made by this instance and older than ``older_than``."""
        return self._staging.cleanup(self.grace_seconds if older_than is None else older_than)

    # ---- catalog -------------------------------------------------------------------------------

    def commit(self, manifest: SnapshotManifest) -> None:
        """Publish a snapshot: its manifest is written once (the first writer wins), blobs first."""
        if manifest.alias is not None:
            check_alias(manifest.alias)
        missing = [d for d in manifest.blobs() if not self.has_blob(d)]
        if missing:
            names = ", ".join(missing)
            raise MissingBlob(f"snapshot {manifest.id!r} names blobs not in the repository: {names}")
        if not self._put_if_absent(manifest_key(manifest.id), manifest.to_json().encode()):
            raise SnapshotExists(f"snapshot {manifest.id!r} is already committed")
        if manifest.alias is not None:
            try:
                self._bind_alias(manifest.alias, manifest.id)
            except AliasConflict:
                self._delete(manifest_key(manifest.id))  # nobody could know its id yet
                raise

    # ---- leases and deletion -------------------------------------------------------------------

    def heartbeat(self) -> None:
        """Tell the other nodes this node (and so its leases) is alive."""
        self._write(f"nodes/{self.node}", b"")
        self._last_beat = time.monotonic()

    def local_leases(self) -> set[str]:
        """Ids of the snapshots this node holds leases on (what its runtime cache must keep).

        Read from the store once, then kept up to date by this instance's acquires and releases.
        """
        with self._leases_lock:
            if self._mine is None:
                mine = set()
                for entry in self._list("leases", "")[0]:
                    snapshot_id, _, holder = entry["Name"].partition("/")
                    if holder and self._read(f"leases/{entry['Name']}") == self.node.encode():
                        mine.add((snapshot_id, holder))
                self._mine = mine
            return {snapshot_id for snapshot_id, _ in self._mine}

    def _note_lease(self, snapshot_id: str, holder: str, held: bool) -> None:
        self.local_leases()  # loaded before the first change
        with self._leases_lock:
            assert self._mine is not None
            (self._mine.add if held else self._mine.discard)((snapshot_id, holder))

    def acquire(self, id_or_alias: str, holder: str) -> SnapshotManifest:
        """Record that ``holder`` uses the snapshot; written before the liveness check (see above)."""
        check_holder(holder)
        if self.lease_ttl is not None and time.monotonic() - self._last_beat > self.lease_ttl / 3:
            self.heartbeat()
        snapshot_id = self.resolve(id_or_alias)
        self._note_lease(snapshot_id, holder, True)
        self._write(f"leases/{snapshot_id}/{holder}", self.node.encode())
        try:
            if not self._is_live(snapshot_id):
                raise SnapshotNotFound(f"snapshot or template {id_or_alias!r} not found")
            return self.get(snapshot_id)
        except BaseException:
            self.release(snapshot_id, holder)
            raise

    def transfer(self, snapshot_id: str, holder: str, to: str) -> None:
        """Hand ``holder``'s lease to ``to``: the new one is written before the old one goes (also
        after a deferred delete, as a held lease keeps its snapshot). Without a lease to hand on,
        ``to`` acquires one."""
        check_holder(holder)
        check_holder(to)
        held = SNAPSHOT_ID_RE.fullmatch(snapshot_id) and self._exists(f"leases/{snapshot_id}/{holder}")
        if not held:
            self.acquire(snapshot_id, to)
            return
        self._note_lease(snapshot_id, to, True)
        self._write(f"leases/{snapshot_id}/{to}", self.node.encode())
        self.release(snapshot_id, holder)

    def release(self, snapshot_id: str, holder: str) -> None:
        """Drop ``holder``'s lease; the last release completes a deferred delete. Idempotent."""
        check_holder(holder)
        check_snapshot_id(snapshot_id)
        self._delete(f"leases/{snapshot_id}/{holder}")
        self._note_lease(snapshot_id, holder, False)
        if self._exists(f"deleted/{snapshot_id}") and not self._held(snapshot_id):
            self._remove(snapshot_id, self.grace_seconds)

    def delete(self, id_or_alias: str, *, defer: bool = True) -> bool:
        """Delete a snapshot; returns True if removed now, False if deferred until its leases end."""
        snapshot_id = self.resolve(id_or_alias)
        if not defer and (holders := self._holders(snapshot_id)):
            raise SnapshotInUse(f"snapshot {snapshot_id!r} is in use by {', '.join(holders)}")
        self._write(f"deleted/{snapshot_id}", b"")
        if not self._holders(snapshot_id):  # counted after the tombstone: see the module docstring
            self._remove(snapshot_id, self.grace_seconds)
            return True
        self._drop_aliases(snapshot_id)
        return False

    # ---- garbage collection --------------------------------------------------------------------

    def gc(self, *, grace_seconds: float | None = None) -> GcReport:
        """Remove what no live or deferred-deleted manifest needs (see the module docstring)."""
        grace = self.grace_seconds if grace_seconds is None else grace_seconds
        blobs, now = self._list("blobs", "sha256", "")  # before the manifests: see the docstring
        removed, freed, aliases = self._collect(grace)
        old = ["sha256:" + e["Name"] for e in blobs if (now - e["LastModified"]).total_seconds() >= grace]
        gone, size = self._sweep_blobs(old, grace)
        self._abort_stale_uploads(grace)
        staging = self.cleanup_staging(grace)
        return GcReport(tuple(removed + gone), freed + size, tuple(aliases), staging)

    def _abort_stale_uploads(self, grace: float) -> None:
        """Multipart uploads left by interrupted `put_blob`s (a killed node) hold storage: end them."""
        answer = self._client.list_multipart_uploads(Bucket=self._bucket, Prefix=self._key("blobs", ""))
        now = parsedate_to_datetime(answer["ResponseMetadata"]["HTTPHeaders"]["date"])
        for upload in answer.get("Uploads", []):
            if (now - upload["Initiated"]).total_seconds() >= grace:
                with contextlib.suppress(ClientError):
                    self._client.abort_multipart_upload(
                        Bucket=self._bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )

    # ---- the catalog's primitives --------------------------------------------------------------

    def _read(self, key: str) -> bytes | None:
        answer = self._get(self._key(key))
        return None if answer is None else answer["Body"].read()

    def _read_aged(self, key: str) -> tuple[bytes, float] | None:
        answer = self._get(self._key(key))
        if answer is None:
            return None
        now = parsedate_to_datetime(answer["ResponseMetadata"]["HTTPHeaders"]["date"])
        return answer["Body"].read(), (now - answer["LastModified"]).total_seconds()

    def _exists(self, key: str) -> bool:
        return self._head(self._key(key)) is not None

    def _write(self, key: str, data: bytes) -> None:
        self._put(self._key(key), data)

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        """``If-None-Match: *``: the store lets one writer of the key win."""
        try:
            self._put(self._key(key), data, IfNoneMatch="*")
        except ClientError as exc:
            if error_code(exc) in PRECONDITION_FAILED:
                return False
            raise
        return True

    def _names(self, prefix: str) -> list[str]:
        return sorted({e["Name"].split("/", 1)[0] for e in self._list(prefix, "")[0]})

    def _delete(self, key: str) -> None:
        self._client.delete_object(Bucket=self._bucket, Key=self._key(key))

    def _delete_tree(self, prefix: str) -> None:
        for entry in self._list(prefix, "")[0]:
            self._client.delete_object(Bucket=self._bucket, Key=entry["Key"])

    def _guard(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # every write that must win is conditional

    def _node_liveness(self) -> NodeLive:
        live = self._live_nodes()
        return lambda node: live is None or node in live or not HOLDER_RE.fullmatch(node)

    def _live_nodes(self) -> set[str] | None:
        """Nodes whose heartbeat is within the lease ttl (None: leases never expire)."""
        if self.lease_ttl is None:
            return None
        beats, now = self._list("nodes", "")
        fresh = {e["Name"] for e in beats if (now - e["LastModified"]).total_seconds() <= self.lease_ttl}
        return fresh | {self.node}

    def _drop_blob(self, digest: str, grace: float) -> int | None:
        """Its LastModified is read again right before the delete (see the module docstring)."""
        key = self._blob_key(digest)
        head = self._head(key)
        if head is None:
            return None
        now = parsedate_to_datetime(head["ResponseMetadata"]["HTTPHeaders"]["date"])
        if (now - head["LastModified"]).total_seconds() < grace:
            return None
        self._client.delete_object(Bucket=self._bucket, Key=key)
        for kind in ("chunks", "profiles"):
            self._client.delete_object(Bucket=self._bucket, Key=self.reader.key(kind, digest))
        return head["ContentLength"]

    def _bind_alias(self, alias: str, snapshot_id: str) -> None:
        """Create the binding, or replace a dangling one; a lost race is retried on what won."""
        key = self._key("aliases", alias)
        for _ in range(8):
            answer = self._get(key)
            etag = None if answer is None else answer["ETag"]
            current = self._live_target(None if answer is None else answer["Body"].read())
            if current == snapshot_id:
                return
            if current is not None:
                raise AliasConflict(
                    f"alias {alias!r} already points to {current!r}, cannot rebind to {snapshot_id!r}"
                )
            condition = {"IfMatch": etag} if etag is not None else {"IfNoneMatch": "*"}
            try:
                self._put(key, snapshot_id.encode(), **condition)
                return
            except ClientError as exc:
                if error_code(exc) not in PRECONDITION_FAILED:
                    raise
        raise RepositoryError(f"alias {alias!r} keeps changing; try again")
