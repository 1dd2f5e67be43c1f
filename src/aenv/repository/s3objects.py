"""The object store under an s3 repository: its client, and the ranged reads on-demand loading makes.

Apart from the repository (`aenv.repository.s3`), so that the node's FUSE server
(`aenv.runtime.lazyfs`, its own process) holds a `BlobReader`, not a repository.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from .chunks import ChunkIndex
from .errors import MissingBlob
from .location import S3Location
from .names import check_digest

PRECONDITION_FAILED = ("PreconditionFailed", "412", "ConditionalRequestConflict")
NOT_FOUND = ("404", "NoSuchKey", "NotFound")


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

    All that on-demand loading needs (`aenv.runtime.lazyfs` holds one, not a repository).
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
            if error_code(exc) in NOT_FOUND:
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
            if error_code(exc) not in PRECONDITION_FAILED:
                raise

    def _get(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.location.bucket, Key=key)["Body"].read()
        except ClientError as exc:
            if error_code(exc) in NOT_FOUND:
                return None
            raise


def error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _hex(digest: str) -> str:
    return check_digest(digest).removeprefix("sha256:")
