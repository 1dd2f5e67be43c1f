"""The snapshot repository on any S3-compatible object store (`Repository`, the `s3` backend).

Same guarantees as the POSIX repository (`aenv.snapshot.repository`), obtained from object-store
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

Staging (the builder tier) is a local directory: captures are written there and uploaded.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import json
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from ..snapshot.manifest import SNAPSHOT_ID_RE, ManifestError, SnapshotManifest
from ..snapshot.repository import (
    ALIAS_RE,
    CHUNK,
    DEFAULT_LEASE_TTL,
    DIGEST_ANYWHERE,
    HOLDER_RE,
    AliasConflict,
    CorruptManifest,
    DigestMismatch,
    GcReport,
    InvalidName,
    MissingBlob,
    PendingMark,
    RepositoryError,
    SnapshotExists,
    SnapshotInUse,
    SnapshotNotFound,
    catalog,
    check_alias,
    check_digest,
    check_holder,
    file_digest,
    mark_names,
    write_fetched,
)
from .chunks import CHUNK_SIZE, ChunkIndex

log = logging.getLogger(__name__)

MIB = 1 << 20
MIN_PART = 5 * MIB  # S3's smallest part (all but the last)
LAZY_MIN = 32 * CHUNK_SIZE  # blobs this large get a chunk index: they may be loaded on demand
PRECONDITION_FAILED = ("PreconditionFailed", "412", "ConditionalRequestConflict")


@dataclasses.dataclass(frozen=True)
class S3Location:
    """Where a repository lives in an object store and how to sign requests to it."""

    bucket: str
    prefix: str = ""
    endpoint: str | None = None
    region: str = "us-east-1"
    access_key: str | None = None
    secret_key: str | None = None

    @classmethod
    def from_url(cls, url: str, **options: Any) -> S3Location:
        """``s3://BUCKET/PREFIX`` plus endpoint, region and credentials."""
        if not url.startswith("s3://") or not url[5:].split("/", 1)[0]:
            raise ValueError(f"an S3 repository is s3://BUCKET/PREFIX, got {url!r}")
        bucket, _, prefix = url[5:].partition("/")
        return cls(bucket=bucket, prefix=prefix.strip("/"), **options)


def s3_client(location: S3Location) -> Any:
    """A boto3 S3 client for the location (thread-safe; path-style addressing, retries)."""
    return boto3.session.Session().client(
        "s3",
        endpoint_url=location.endpoint,
        region_name=location.region,
        aws_access_key_id=location.access_key,
        aws_secret_access_key=location.secret_key,
        config=Config(
            s3={"addressing_style": "path"},
            retries={"max_attempts": 5, "mode": "standard"},
            # Integrity is checked explicitly (sha256 of whole blobs and of chunks, MD5 of parts).
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            max_pool_connections=32,
        ),
    )


class BlobReader:
    """Ranged reads of a repository's blobs, their chunk indexes and restore profiles.

    All that on-demand loading needs (`aenv.storage.lazyfs` holds one, not a repository).
    Keys beside ``blobs/``: ``chunks/<hex>`` (the blob's `ChunkIndex`, written by the node that
    stored it) and ``profiles/<hex>`` (the chunks a restore from the blob read, recorded by the
    first node that restored from it; a prefetch list, never trusted for content).
    """

    def __init__(self, location: S3Location):
        self.location = location
        self.client = s3_client(location)
        self._prefix = f"{location.prefix}/" if location.prefix else ""

    def key(self, kind: str, digest: str) -> str:
        return f"{self._prefix}{kind}/" + ("sha256/" if kind == "blobs" else "") + _hex(digest)

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        """`length` bytes of the blob at `offset` (one ranged GET)."""
        try:
            answer = self.client.get_object(
                Bucket=self.location.bucket, Key=self.key("blobs", digest),
                Range=f"bytes={offset}-{offset + length - 1}",
            )  # fmt: skip
        except ClientError as exc:
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                raise MissingBlob(f"blob {digest} is not in the repository") from None
            raise
        with contextlib.closing(answer["Body"]) as body:
            return body.read()

    def chunk_index(self, digest: str) -> ChunkIndex | None:
        """The blob's chunk index, or None if it has none (small, or stored before indexes)."""
        data = self._get(self.key("chunks", digest))
        return None if data is None else ChunkIndex.from_json(data)

    def profile(self, digest: str) -> list[int] | None:
        """The chunks a restore from this memory image read, if a node recorded them."""
        data = self._get(self.key("profiles", digest))
        if data is None:
            return None
        with contextlib.suppress(ValueError, TypeError):
            return [int(i) for i in json.loads(data)]
        return None  # a damaged profile only costs a slower start

    def record_profile(self, digest: str, chunks: list[int]) -> None:
        """Record what a restore from memory image `digest` read; the first node's record stays."""
        body = json.dumps(chunks).encode()
        md5 = base64.b64encode(hashlib.md5(body).digest()).decode()
        try:
            self.client.put_object(
                Bucket=self.location.bucket, Key=self.key("profiles", digest), Body=body, ContentMD5=md5,
                IfNoneMatch="*",
            )  # fmt: skip
        except ClientError as exc:
            if _code(exc) not in PRECONDITION_FAILED:
                raise

    def _get(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.location.bucket, Key=key)["Body"].read()
        except ClientError as exc:
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise


class S3Repository:
    """Committed snapshots and their blobs in an S3 bucket; safe for threads and for many nodes."""

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
        self._staging = staging
        staging.mkdir(parents=True, exist_ok=True)
        self._own_staging: set[Path] = set()
        self._leases_lock = threading.Lock()
        self._mine: set[tuple[str, str]] | None = None  # (snapshot, holder) leased by this node
        self._last_beat = 0.0

    # ---- object helpers ------------------------------------------------------------------------

    def _key(self, *parts: str) -> str:
        return self._prefix + "/".join(parts)

    def _blob_key(self, digest: str) -> str:
        return self._key("blobs", "sha256", check_digest(digest).removeprefix("sha256:"))

    def _create_bucket(self) -> None:
        try:
            self._client.create_bucket(Bucket=self._bucket)
        except ClientError as exc:
            if _code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    def _head(self, key: str) -> dict[str, Any] | None:
        try:
            return self._client.head_object(Bucket=self._bucket, Key=key)
        except ClientError as exc:
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def _read(self, key: str) -> bytes | None:
        try:
            return self._client.get_object(Bucket=self._bucket, Key=key)["Body"].read()
        except ClientError as exc:
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def _put(self, key: str, data: bytes, **conditions: str) -> dict[str, Any]:
        md5 = base64.b64encode(hashlib.md5(data).digest()).decode()
        return self._client.put_object(Bucket=self._bucket, Key=key, Body=data, ContentMD5=md5, **conditions)

    def _delete(self, key: str) -> None:
        self._client.delete_object(Bucket=self._bucket, Key=key)

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
        try:
            body = self._client.get_object(Bucket=self._bucket, Key=self._blob_key(digest))["Body"]
        except ClientError as exc:
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                raise MissingBlob(f"blob {digest} is not in the repository") from None
            raise
        with contextlib.closing(body):
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
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
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
            if _code(exc) in ("BadDigest", "XAmzContentSHA256Mismatch", "InvalidDigest"):
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
        path = Path(tempfile.mkdtemp(prefix="s-", dir=self._staging))
        self._own_staging.add(path)
        return path

    def pending_dir(self) -> Path:
        """Captures awaiting their commit (upload): a local directory beside staging."""
        return self._staging.parent / "pending"

    def discard_staging(self, path: Path) -> None:
        self._own_staging.discard(Path(path))
        shutil.rmtree(path, ignore_errors=True)

    def cleanup_staging(self, older_than: float | None = None) -> int:
        """Remove local staging entries not made by this instance and older than ``older_than``."""
        cutoff = time.time() - (self.grace_seconds if older_than is None else older_than)
        removed = 0
        for entry in self._staging.iterdir():
            if entry in self._own_staging:
                continue
            with contextlib.suppress(FileNotFoundError):
                if entry.lstat().st_mtime <= cutoff:
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
                    removed += 1
        return removed

    # ---- catalog -------------------------------------------------------------------------------

    def commit(self, manifest: SnapshotManifest) -> None:
        """Publish a snapshot: its manifest is written once (the first writer wins), blobs first."""
        if manifest.alias is not None:
            check_alias(manifest.alias)
        missing = [d for d in manifest.blobs() if not self.has_blob(d)]
        if missing:
            names = ", ".join(missing)
            raise MissingBlob(f"snapshot {manifest.id!r} names blobs not in the repository: {names}")
        try:
            self._put(self._manifest_key(manifest.id), manifest.to_json().encode(), IfNoneMatch="*")
        except ClientError as exc:
            if _code(exc) in PRECONDITION_FAILED:
                raise SnapshotExists(f"snapshot {manifest.id!r} is already committed") from None
            raise
        if manifest.alias is not None:
            try:
                self._bind_alias(manifest.alias, manifest.id)
            except AliasConflict:
                self._delete(self._manifest_key(manifest.id))  # nobody could know its id yet
                raise

    def resolve(self, id_or_alias: str) -> str:
        """The id of the live snapshot with this id or, failing that, this alias."""
        if isinstance(id_or_alias, str):
            if SNAPSHOT_ID_RE.fullmatch(id_or_alias) and self._is_live(id_or_alias):
                return id_or_alias
            if ALIAS_RE.fullmatch(id_or_alias):
                target = self._alias_target(id_or_alias)[0]
                if target is not None:
                    return target
        raise SnapshotNotFound(f"snapshot or template {id_or_alias!r} not found")

    def get(self, id_or_alias: str) -> SnapshotManifest:
        """The manifest of a live snapshot, its ``alias`` set to the alias currently bound to it."""
        snapshot_id = self.resolve(id_or_alias)
        manifest = self._load(snapshot_id)
        if manifest.alias is not None and self._alias_target(manifest.alias)[0] == snapshot_id:
            return manifest
        aliases = self._aliases_by_id().get(snapshot_id, [])
        return dataclasses.replace(manifest, alias=aliases[0] if aliases else None)

    def list(self, kind: str | None = None) -> list[SnapshotManifest]:
        """Live snapshots, newest first (ties by id); unreadable manifests are logged and skipped."""
        deleted = {o["Name"] for o in self._list("deleted", "")[0]}
        ids = (entry["Name"].removesuffix(".json") for entry in self._list("manifests", "")[0])
        live = [i for i in ids if i not in deleted and SNAPSHOT_ID_RE.fullmatch(i)]
        return catalog(live, self._load, self._aliases_by_id(), kind)

    def set_alias(self, alias: str, id_or_alias: str) -> None:
        """Bind ``alias`` to a live snapshot; ``AliasConflict`` if it is bound to another one."""
        check_alias(alias)
        self._bind_alias(alias, self.resolve(id_or_alias))

    def remove_alias(self, alias: str) -> None:
        """Unbind ``alias`` (the snapshot stays); ``SnapshotNotFound`` if it is not bound."""
        check_alias(alias)
        if self._alias_target(alias)[0] is None:
            raise SnapshotNotFound(f"alias {alias!r} not found")
        self._delete(self._key("aliases", alias))

    def is_live(self, snapshot_id: str) -> bool:
        return bool(SNAPSHOT_ID_RE.fullmatch(snapshot_id)) and self._is_live(snapshot_id)

    # ---- leases and deletion -------------------------------------------------------------------

    def heartbeat(self) -> None:
        """Tell the other nodes this node (and so its leases) is alive."""
        self._put(self._key("nodes", self.node), b"")
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
                    if holder and self._read(entry["Key"]) == self.node.encode():
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
        lease = self._key("leases", snapshot_id, holder)
        self._note_lease(snapshot_id, holder, True)
        self._put(lease, self.node.encode())
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
        held = SNAPSHOT_ID_RE.fullmatch(snapshot_id) and self._head(self._key("leases", snapshot_id, holder))
        if not held:
            self.acquire(snapshot_id, to)
            return
        self._note_lease(snapshot_id, to, True)
        self._put(self._key("leases", snapshot_id, to), self.node.encode())
        self.release(snapshot_id, holder)

    def release(self, snapshot_id: str, holder: str) -> None:
        """Drop ``holder``'s lease; the last release completes a deferred delete. Idempotent."""
        check_holder(holder)
        if not SNAPSHOT_ID_RE.fullmatch(snapshot_id):
            raise InvalidName(f"invalid snapshot id {snapshot_id!r}")
        self._delete(self._key("leases", snapshot_id, holder))
        self._note_lease(snapshot_id, holder, False)
        if self._head(self._key("deleted", snapshot_id)) is not None and not self._holders(snapshot_id):
            self._remove(snapshot_id, self.grace_seconds)

    def leased(self, snapshot_id: str, holder: str) -> SnapshotManifest:
        """The manifest a lease holder runs from, also after a deferred delete hid it from `get`."""
        check_holder(holder)
        lease = self._key("leases", snapshot_id, holder) if SNAPSHOT_ID_RE.fullmatch(snapshot_id) else None
        if lease is None or self._head(lease) is None:
            raise SnapshotNotFound(f"{holder!r} holds no lease on snapshot {snapshot_id!r}")
        return self._load(snapshot_id)

    def holders(self, id_or_alias: str) -> list[str]:
        """Sorted holders of live leases (a deferred-deleted snapshot's too, given its id)."""
        if (
            isinstance(id_or_alias, str)
            and SNAPSHOT_ID_RE.fullmatch(id_or_alias)
            and self._head(self._manifest_key(id_or_alias)) is not None
        ):
            return self._holders(id_or_alias)
        return self._holders(self.resolve(id_or_alias))

    def delete(self, id_or_alias: str, *, defer: bool = True) -> bool:
        """Delete a snapshot; returns True if removed now, False if deferred until its leases end."""
        snapshot_id = self.resolve(id_or_alias)
        if not defer and (holders := self._holders(snapshot_id)):
            raise SnapshotInUse(f"snapshot {snapshot_id!r} is in use by {', '.join(holders)}")
        self._put(self._key("deleted", snapshot_id), b"")
        if not self._holders(snapshot_id):  # counted after the tombstone: see the module docstring
            self._remove(snapshot_id, self.grace_seconds)
            return True
        self._drop_aliases(snapshot_id)
        return False

    # ---- claims (a hand-over that happens once) --------------------------------------------------

    def claim(self, snapshot_id: str) -> str:
        """Take the snapshot over for this node: the first conditional write wins; returns the winner."""
        key = self._claim_key(snapshot_id)
        try:
            self._put(key, self.node.encode(), IfNoneMatch="*")
        except ClientError as exc:
            if _code(exc) not in PRECONDITION_FAILED:
                raise
        return self.claimant(snapshot_id) or self.node

    def claimant(self, snapshot_id: str) -> str | None:
        data = self._read(self._claim_key(snapshot_id))
        return None if data is None else data.decode()

    def unclaim(self, snapshot_id: str) -> None:
        """Give up this node's claim (a take-over that failed before it used the snapshot)."""
        if self.claimant(snapshot_id) == self.node:
            self._delete(self._claim_key(snapshot_id))

    def _claim_key(self, snapshot_id: str) -> str:
        if not isinstance(snapshot_id, str) or not SNAPSHOT_ID_RE.fullmatch(snapshot_id):
            raise InvalidName(f"invalid snapshot id {snapshot_id!r}")
        return self._key("claims", snapshot_id)

    # ---- pending marks (snapshots answered, committed in the background) --------------------------

    def mark_pending(self, snapshot_id: str, alias: str | None = None, failure: str | None = None) -> None:
        """Tell the other nodes this node commits the snapshot (or that its commit failed)."""
        if not SNAPSHOT_ID_RE.fullmatch(snapshot_id):
            raise InvalidName(f"invalid snapshot id {snapshot_id!r}")
        mark = PendingMark(snapshot_id, self.node, failure, stale=False).to_json()
        for name in mark_names(snapshot_id, alias):
            self._put(self._key("pending", name), mark)

    def unmark_pending(self, snapshot_id: str, alias: str | None = None) -> None:
        for name in mark_names(snapshot_id, alias):
            self._delete(self._key("pending", name))

    def pending_mark(self, id_or_alias: str) -> PendingMark | None:
        """The mark of a snapshot another node is committing, by id or alias (None: none)."""
        if not (SNAPSHOT_ID_RE.fullmatch(id_or_alias) or ALIAS_RE.fullmatch(id_or_alias)):
            return None
        try:
            answer = self._client.get_object(Bucket=self._bucket, Key=self._key("pending", id_or_alias))
        except ClientError as exc:
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        now = parsedate_to_datetime(answer["ResponseMetadata"]["HTTPHeaders"]["date"])
        age = (now - answer["LastModified"]).total_seconds()
        live = self._live_nodes()
        return PendingMark.parse(
            answer["Body"].read(), age=age, node_live=lambda node: live is None or node in live,
            grace=self.grace_seconds,
        )  # fmt: skip

    # ---- garbage collection --------------------------------------------------------------------

    def gc(self, *, grace_seconds: float | None = None) -> GcReport:
        """Remove what no live or deferred-deleted manifest needs (see the module docstring)."""
        grace = self.grace_seconds if grace_seconds is None else grace_seconds
        blobs, now = self._list("blobs", "sha256", "")  # before the manifests: see the docstring
        manifests = {e["Name"].removesuffix(".json") for e in self._list("manifests", "")[0]}
        live = self._live_nodes()
        for entry in self._list("leases", "")[0]:
            snapshot_id = entry["Name"].split("/", 1)[0]
            if snapshot_id not in manifests or not self._lease_live(entry["Key"], live):
                self._delete(entry["Key"])
        removed, freed = [], 0
        for entry in self._list("deleted", "")[0]:
            if entry["Name"] not in manifests:
                self._delete(entry["Key"])
            elif not self._holders(entry["Name"]):
                gone, size = self._remove(entry["Name"], grace)
                removed += gone
                freed += size
        for entry in self._list("claims", "")[0]:
            if entry["Name"] not in manifests:
                self._delete(entry["Key"])
        for entry in self._list("pending", "")[0]:
            if (mark := self.pending_mark(entry["Name"])) is not None and mark.stale:
                self._delete(entry["Key"])
        removed_aliases = []
        for entry in self._list("aliases", "")[0]:
            if self._alias_target(entry["Name"])[0] is None:
                self._delete(entry["Key"])
                removed_aliases.append(entry["Name"])
        old = [e for e in blobs if (now - e["LastModified"]).total_seconds() >= grace]
        gone, size = self._sweep_blobs(["sha256:" + e["Name"] for e in old], grace)
        self._abort_stale_uploads(grace)
        staging = self.cleanup_staging(grace)
        return GcReport(tuple(removed + gone), freed + size, tuple(sorted(removed_aliases)), staging)

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

    # ---- internals -----------------------------------------------------------------------------

    def _manifest_key(self, snapshot_id: str) -> str:
        return self._key("manifests", f"{snapshot_id}.json")

    def _is_live(self, snapshot_id: str) -> bool:
        return (
            self._head(self._manifest_key(snapshot_id)) is not None
            and self._head(self._key("deleted", snapshot_id)) is None
        )

    def _load(self, snapshot_id: str) -> SnapshotManifest:
        text = self._read(self._manifest_key(snapshot_id))
        if text is None:
            raise SnapshotNotFound(f"snapshot or template {snapshot_id!r} not found")
        try:
            return SnapshotManifest.from_json(text)
        except ManifestError as exc:
            raise CorruptManifest(f"manifest of snapshot {snapshot_id!r} is unreadable: {exc}") from exc

    def _alias_target(self, alias: str) -> tuple[str | None, str | None]:
        """The live snapshot id ``alias`` points to (None if unbound or dangling), and its ETag."""
        try:
            answer = self._client.get_object(Bucket=self._bucket, Key=self._key("aliases", alias))
        except ClientError as exc:
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None, None
            raise
        target = answer["Body"].read().decode(errors="replace").strip()
        live = SNAPSHOT_ID_RE.fullmatch(target) and self._is_live(target)
        return (target if live else None), answer["ETag"]

    def _aliases_by_id(self) -> dict[str, list[str]]:
        by_id: dict[str, list[str]] = {}
        for entry in sorted(self._list("aliases", "")[0], key=lambda e: e["Name"]):
            target = self._alias_target(entry["Name"])[0]
            if target is not None:
                by_id.setdefault(target, []).append(entry["Name"])
        return by_id

    def _bind_alias(self, alias: str, snapshot_id: str) -> None:
        """Create the binding, or replace a dangling one; a lost race is retried on what won."""
        key = self._key("aliases", alias)
        for _ in range(8):
            current, etag = self._alias_target(alias)
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
                if _code(exc) not in PRECONDITION_FAILED:
                    raise
        raise RepositoryError(f"alias {alias!r} keeps changing; try again")

    def _drop_aliases(self, snapshot_id: str) -> None:
        for entry in self._list("aliases", "")[0]:
            if self._read(entry["Key"]) == snapshot_id.encode():
                self._delete(entry["Key"])

    def _live_nodes(self) -> set[str] | None:
        """Nodes whose heartbeat is within the lease ttl (None: leases never expire)."""
        if self.lease_ttl is None:
            return None
        beats, now = self._list("nodes", "")
        fresh = {e["Name"] for e in beats if (now - e["LastModified"]).total_seconds() <= self.lease_ttl}
        return fresh | {self.node}

    def _lease_live(self, key: str, live_nodes: set[str] | None) -> bool:
        if live_nodes is None:
            return True
        node = (self._read(key) or b"").decode(errors="replace")
        return node in live_nodes or not HOLDER_RE.fullmatch(node)

    def _holders(self, snapshot_id: str) -> list[str]:
        """Holders of live leases (those of dead nodes have expired)."""
        leases = self._list("leases", snapshot_id, "")[0]
        if not leases:
            return []
        live = self._live_nodes()
        return sorted(e["Name"] for e in leases if self._lease_live(e["Key"], live))

    def _remove(self, snapshot_id: str, grace: float) -> tuple[list[str], int]:
        """Remove a snapshot for good, then the blobs only it used; returns them and bytes freed."""
        try:
            blobs = self._load(snapshot_id).blobs()
        except (CorruptManifest, SnapshotNotFound):
            blobs = None  # unknown contents: leave its blobs to gc's conservative scan
        self._drop_aliases(snapshot_id)
        self._delete(self._manifest_key(snapshot_id))
        self._delete(self._key("deleted", snapshot_id))
        self._delete(self._claim_key(snapshot_id))
        for entry in self._list("leases", snapshot_id, "")[0]:
            self._delete(entry["Key"])
        return self._sweep_blobs(blobs, grace) if blobs else ([], 0)

    def _referenced(self) -> set[str]:
        """Every digest any manifest mentions, found textually (unparseable manifests count too)."""
        found: set[str] = set()
        for entry in self._list("manifests", "")[0]:
            text = self._read(entry["Key"])
            if text is not None:
                found.update(DIGEST_ANYWHERE.findall(text.decode(errors="replace")))
        return found

    def _sweep_blobs(self, candidates: list[str], grace: float) -> tuple[list[str], int]:
        """Delete candidates no manifest names whose LastModified, read again now, is past grace."""
        referenced = self._referenced()
        removed, freed = [], 0
        for digest in sorted(set(candidates) - referenced):
            key = self._blob_key(digest)
            head = self._head(key)
            if head is None:
                continue
            now = parsedate_to_datetime(head["ResponseMetadata"]["HTTPHeaders"]["date"])
            if (now - head["LastModified"]).total_seconds() < grace:
                continue
            self._delete(key)
            for kind in ("chunks", "profiles"):
                self._delete(self.reader.key(kind, digest))
            removed.append(digest)
            freed += head["ContentLength"]
        return removed, freed


def _hex(digest: str) -> str:
    return check_digest(digest).removeprefix("sha256:")


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))
