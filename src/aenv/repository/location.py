"""Where an s3 repository lives: a bucket, a prefix, an endpoint and the credentials to sign with.

Apart from `aenv.repository.s3` (which needs boto3) so that the settings' checks, the node's
FUSE server and the code opening a repository from its URL can name a location without it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

S3_SCHEME = "s3://"


def is_s3_url(url: str) -> bool:
    """Whether a repository URL names an object store (else it is a directory)."""
    return url.startswith(S3_SCHEME)


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
        bucket, _, prefix = url.removeprefix(S3_SCHEME).partition("/")
        if not is_s3_url(url) or not bucket:
            raise ValueError(f"an S3 repository is s3://BUCKET/PREFIX, got {url!r}")
        return cls(bucket=bucket, prefix=prefix.strip("/"), **options)
