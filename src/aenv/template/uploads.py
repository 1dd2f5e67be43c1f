"""Build-context uploads: presigned URLs served by the node itself, and the files they bring.

The SDK asks ``GET /templates/{id}/files/{hash}`` for each ``COPY`` and, unless the files are
already here, ``PUT``s a tar(.gz) of them to the URL it gets back, without the API key (as it
would to S3). The URL carries an expiry and an HMAC over template, hash and expiry with a key
only this node process knows, so it cannot be forged, reused later or pointed at another hash.
An upload is kept as *pending* under its hash; the build that uses it checks the content
against the hash (which needs the step's source and destination) and only then marks it
*present*, so a wrong upload can never be taken for the right files.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path

from aenv.template.image import ImageError
from aenv.template.steps import FILES_HASH

URL_TTL = 3600  # seconds; the SDK uploads right after asking
MAX_UPLOAD = 512 << 20  # bytes of one COPY's archive


class UploadRefused(ImageError):
    """A PUT that is not a valid use of a presigned URL (signature, expiry, size, hash)."""

    status = 403


class UploadStore:
    """``pending/<hash>`` as uploaded, ``present/<hash>`` once a build checked it."""

    def __init__(self, root: Path, *, max_bytes: int = MAX_UPLOAD):
        self.root = root
        self.max_bytes = max_bytes
        self._key = secrets.token_bytes(32)
        for sub in ("pending", "present", "tmp"):
            (root / sub).mkdir(parents=True, exist_ok=True)

    @staticmethod
    def check_hash(files_hash: str) -> str:
        if not FILES_HASH.fullmatch(files_hash):
            raise ImageError(f"invalid files hash {files_hash!r}: 64 lowercase hex digits expected")
        return files_hash

    def present(self, files_hash: str) -> bool:
        return (self.root / "present" / self.check_hash(files_hash)).exists()

    def sign(self, template_id: str, files_hash: str, *, now: float | None = None) -> tuple[int, str]:
        """Expiry and signature of an upload URL for these files of this template."""
        expires = int((now or time.time()) + URL_TTL)
        return expires, self._mac(template_id, files_hash, expires)

    def _mac(self, template_id: str, files_hash: str, expires: int) -> str:
        message = f"{template_id}\n{files_hash}\n{expires}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def authorize(self, template_id: str, files_hash: str, expires: str, signature: str) -> None:
        """Refuse (``UploadRefused``) a PUT whose URL was not signed here or has expired."""
        self.check_hash(files_hash)
        if not expires.isdigit() or not hmac.compare_digest(
            self._mac(template_id, files_hash, int(expires)), signature
        ):
            raise UploadRefused("invalid upload signature")
        if int(expires) < time.time():
            raise UploadRefused("the upload URL has expired")

    async def receive(self, files_hash: str, chunks: AsyncIterator[bytes], declared: int | None) -> int:
        """Store an upload as pending; refuses more than ``max_bytes`` without keeping any of it."""
        if declared is not None and declared > self.max_bytes:
            raise UploadRefused(f"upload larger than {self.max_bytes >> 20} MiB")
        temp = self.root / "tmp" / f"{files_hash}.{secrets.token_hex(4)}"
        size = 0
        try:
            with temp.open("wb") as out:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise UploadRefused(f"upload larger than {self.max_bytes >> 20} MiB")
                    out.write(chunk)
            os.replace(temp, self.root / "pending" / files_hash)
        finally:
            temp.unlink(missing_ok=True)
        return size

    def archive(self, files_hash: str) -> Path:
        """The stored files for a hash, checked or not (``ImageError`` if never uploaded)."""
        for state in ("present", "pending"):
            path = self.root / state / self.check_hash(files_hash)
            if path.exists():
                return path
        raise ImageError(f"the files of hash {files_hash} were never uploaded")

    def mark_present(self, files_hash: str) -> None:
        """A build checked the pending upload against its hash: later builds may skip it."""
        pending = self.root / "pending" / files_hash
        if pending.exists():
            os.replace(pending, self.root / "present" / files_hash)

    def discard(self, files_hash: str) -> None:
        """Forget a pending upload that failed its check, so the SDK is asked for it again."""
        (self.root / "pending" / files_hash).unlink(missing_ok=True)
