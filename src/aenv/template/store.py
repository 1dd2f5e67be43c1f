"""The node's image store: verified blobs cached by digest, and the three ways images arrive.

Layout under ``root`` (by default ``<node home>/images``)::

    blobs/sha256/<hex>   manifests, configs and layers, each stored only after its bytes were
                         checked against the digest and size that named it (mode 0444)
    tmp/                 downloads in progress (same filesystem, renamed into place)

A blob is written once and then shared by every image that names it, so a second pull of the
same or a related image only fetches the manifest. Images come from a registry (``pull``), an
OCI layout directory or a ``docker save`` tarball; all three end in the same ``Image``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from aenv.paths import home_dir
from aenv.template.image import (
    INDEX_TYPES,
    LAYER_TYPES,
    MANIFEST_TYPES,
    MAX_DOCUMENT,
    OCI_LAYER,
    OCI_MANIFEST,
    PLATFORM,
    ConfigDocument,
    Descriptor,
    Image,
    ImageConfig,
    ImageError,
    ImageNotFound,
    Index,
    IntegrityError,
    Layer,
    Manifest,
    RegistryError,
    UnsupportedImage,
    document_type,
    parse_document,
    select_platform,
    sha256_digest,
)
from aenv.template.reference import parse_reference
from aenv.template.registry import Credentials, RegistryClient
from aenv.template.unpack import compression

log = logging.getLogger(__name__)

CHUNK = 1 << 20
MAX_INDEX_DEPTH = 3
REF_NAME = "org.opencontainers.image.ref.name"

Fetch = Callable[[Descriptor], Iterator[bytes]]
Progress = Callable[[str], None]


class ImageStore:
    """Verified image blobs under one directory; safe for concurrent pulls of the same image."""

    def __init__(self, root: Path | str | None = None):
        self.root = Path(root) if root is not None else home_dir() / "images"
        self._blobs = self.root / "blobs" / "sha256"
        self._tmp = self.root / "tmp"
        self._blobs.mkdir(parents=True, exist_ok=True)
        self._tmp.mkdir(exist_ok=True)

    def blob_path(self, digest: str) -> Path:
        return self._blobs / digest.removeprefix("sha256:")

    # ---- sources ------------------------------------------------------------------------------

    def pull(
        self, reference: str, credentials: Credentials | None = None, *, progress: Progress | None = None
    ) -> Image:
        """Pull ``reference`` (linux/amd64) from its registry; blobs already stored are not fetched."""
        ref = parse_reference(reference)
        with RegistryClient(ref, credentials) as client:
            source = f"registry {ref.registry}"
            if ref.digest and self.blob_path(ref.digest).exists():
                body, declared = self.blob_path(ref.digest).read_bytes(), ""
            else:
                body, declared = client.manifest(ref.ref)
                self._store(_once(body), None, source)
            return self._image(
                str(ref),
                body,
                declared,
                manifests=lambda d: client.manifest_chunks(d.digest),
                blobs=lambda d: client.blob_chunks(d.digest),
                source=source,
                progress=progress,
            )

    def import_oci_layout(self, path: Path | str, tag: str | None = None) -> Image:
        """Import the image of an OCI layout directory (the one named ``tag`` if it holds several)."""
        layout = Path(path)
        if not (layout / "oci-layout").is_file():
            raise ImageNotFound(f"{layout} is not an OCI layout directory (no oci-layout file)")
        index_bytes = _read_document(layout / "index.json")
        index = parse_document(Index, index_bytes, f"{layout}/index.json")
        named = [d for d in index.manifests if tag is None or (d.annotations or {}).get(REF_NAME) == tag]
        if not named:
            raise ImageNotFound(f"{layout} holds no image named {tag!r}")
        chosen = named[0] if len(named) == 1 else select_platform(Index(schemaVersion=2, manifests=named))

        def blobs(descriptor: Descriptor) -> Iterator[bytes]:
            return _file_chunks(layout / "blobs" / "sha256" / descriptor.digest.removeprefix("sha256:"))

        source = f"OCI layout {layout}"
        body = self._fetch(chosen, blobs, source).read_bytes()
        reference = f"oci:{layout}" + (f":{tag}" if tag else "")
        return self._image(reference, body, chosen.media_type, blobs, blobs, source)

    def import_docker_archive(self, path: Path | str, tag: str | None = None) -> Image:
        """Import an image from a ``docker save`` tarball (plain or gzip-compressed).

        The archive has no registry manifest, so an OCI manifest is made up from its
        ``manifest.json``; the image's ``config_digest`` is the same as from a registry.
        """
        archive = Path(path)
        source = f"docker archive {archive}"
        try:
            with tarfile.open(archive, "r:*") as tar:
                members = {os.path.normpath(m.name).lstrip("/"): m for m in tar.getmembers()}
                entry = _archive_entry(_read_member(tar, members, "manifest.json", source), tag, source)
                config_bytes = _read_member(tar, members, entry["Config"], source)
                config = self._store(_once(config_bytes), None, source)
                layers = []
                for name in entry["Layers"]:
                    blob = self._store(_member_chunks(tar, members, name, source), None, source)
                    media_type = OCI_LAYER + {"gzip": "+gzip", "zstd": "+zstd"}.get(compression(blob), "")
                    layers.append(
                        {"mediaType": media_type, "digest": f"sha256:{blob.name}", "size": _size(blob)}
                    )
        except (tarfile.TarError, EOFError, OSError, RecursionError) as exc:
            raise ImageError(f"{source} cannot be read: {exc}") from None
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": f"sha256:{config.name}",
                "size": len(config_bytes),
            },
            "layers": layers,
        }
        body = json.dumps(manifest, separators=(",", ":")).encode()
        self._store(_once(body), None, source)

        def stored(descriptor: Descriptor) -> Iterator[bytes]:
            raise ImageNotFound(f"{source} lacks blob {descriptor.digest}")

        reference = (entry.get("RepoTags") or [None])[0] or f"docker-archive:{archive}"
        return self._image(reference, body, OCI_MANIFEST, stored, stored, source)

    # ---- resolution -----------------------------------------------------------------------------

    def _image(
        self,
        reference: str,
        body: bytes,
        declared: str,
        manifests: Fetch,
        blobs: Fetch,
        source: str,
        progress: Progress | None = None,
    ) -> Image:
        """Follow indexes to the linux/amd64 manifest, then fetch and check its config and layers."""
        media_type = document_type(body, declared)
        for _ in range(MAX_INDEX_DEPTH):
            if media_type not in INDEX_TYPES:
                break
            chosen = select_platform(parse_document(Index, body, f"image index of {reference}"))
            body = self._fetch(chosen, manifests, source).read_bytes()
            media_type = document_type(body, chosen.media_type)
        if media_type not in MANIFEST_TYPES:
            raise UnsupportedImage(f"{reference}: unsupported manifest type {media_type!r}")
        manifest = parse_document(Manifest, body, f"manifest of {reference}")
        if manifest.config.size > MAX_DOCUMENT:
            raise RegistryError(
                f"{reference}: image config of {manifest.config.size} bytes is implausibly large"
            )
        for layer in manifest.layers:
            if layer.media_type not in LAYER_TYPES or layer.urls:
                raise UnsupportedImage(
                    f"{reference}: layer {layer.digest} has unsupported type {layer.media_type!r}"
                )
        config_bytes = self._fetch(manifest.config, blobs, source).read_bytes()
        config = parse_document(ConfigDocument, config_bytes, f"image config of {reference}")
        if (config.os, config.architecture) != PLATFORM:
            raise UnsupportedImage(
                f"{reference} is for {config.os}/{config.architecture}, not {'/'.join(PLATFORM)}"
            )
        diff_ids = config.rootfs.diff_ids
        if len(diff_ids) != len(manifest.layers):
            raise RegistryError(
                f"{reference}: manifest has {len(manifest.layers)} layers, config {len(diff_ids)}"
            )
        layers = []
        for descriptor, diff_id in zip(manifest.layers, diff_ids, strict=True):
            if progress is not None and not self.blob_path(descriptor.digest).exists():
                progress(f"pulling {descriptor.digest} ({descriptor.size / 1e6:.1f} MB)")
            path = self._fetch(descriptor, blobs, source)
            layers.append(Layer(descriptor.digest, descriptor.size, descriptor.media_type, diff_id, path))
        return Image(
            reference,
            sha256_digest(body),
            manifest.config.digest,
            ImageConfig.from_document(config),
            tuple(layers),
        )

    # ---- blobs --------------------------------------------------------------------------------

    def _fetch(self, descriptor: Descriptor, fetch: Fetch, source: str) -> Path:
        """The stored blob a descriptor names, fetched and verified first if it is missing."""
        path = self.blob_path(descriptor.digest)
        if path.exists():
            return path
        log.info("fetching %s (%d bytes) from %s", descriptor.digest, descriptor.size, source)
        return self._store(fetch(descriptor), descriptor, source)

    def _store(self, chunks: Iterator[bytes], expected: Descriptor | None, source: str) -> Path:
        """Write a byte stream into the store under its sha256, checking it against ``expected``.

        Reading stops as soon as more bytes arrive than ``expected`` declares, so a lying
        source cannot fill the disk; nothing reaches ``blobs/`` unless it matched.
        """
        fd, name = tempfile.mkstemp(dir=self._tmp, prefix="blob-")
        tmp = Path(name)
        h = hashlib.sha256()
        size = 0
        try:
            with os.fdopen(fd, "wb") as out, contextlib.closing(chunks):
                for chunk in chunks:
                    size += len(chunk)
                    if expected is not None and size > expected.size:
                        declared = f"the {expected.size} bytes declared for {expected.digest}"
                        raise IntegrityError(f"{source} sent more than {declared}")
                    h.update(chunk)
                    out.write(chunk)
            digest = "sha256:" + h.hexdigest()
            if expected is not None and size != expected.size:
                raise IntegrityError(
                    f"{source} sent {size} bytes for {expected.digest}, which declares {expected.size}"
                )
            if expected is not None and digest != expected.digest:
                raise IntegrityError(f"{source} sent content hashing to {digest} for {expected.digest}")
            tmp.chmod(0o444)
            final = self.blob_path(digest)
            os.replace(tmp, final)
            return final
        finally:
            tmp.unlink(missing_ok=True)


def _size(path: Path) -> int:
    return path.stat().st_size


def _once(data: bytes) -> Iterator[bytes]:
    yield data


def _file_chunks(path: Path) -> Iterator[bytes]:
    """A local blob's bytes; symlinks and non-files are refused (layouts may be user-supplied)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ImageNotFound(f"blob {path.name} is missing from {path.parent.parent.parent}") from None
    except OSError as exc:
        raise ImageError(f"cannot read {path}: {exc.strerror}") from None
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ImageError(f"{path} is not a regular file")
        while chunk := f.read(CHUNK):
            yield chunk


def _read_document(path: Path) -> bytes:
    data = b"".join(_file_chunks(path))
    if len(data) > MAX_DOCUMENT:
        raise ImageError(f"{path} is larger than {MAX_DOCUMENT} bytes")
    return data


def _member(members: dict[str, tarfile.TarInfo], name: object, source: str) -> tarfile.TarInfo:
    member = members.get(os.path.normpath(name).lstrip("/")) if isinstance(name, str) else None
    if member is None or not (member.isreg() or member.issym() or member.islnk()):
        raise ImageError(f"{source} has no file {name!r}")
    return member


def _member_chunks(
    tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo], name: object, source: str
) -> Iterator[bytes]:
    stream = tar.extractfile(_member(members, name, source))
    if stream is None:
        raise ImageError(f"{source}: {name!r} is not a file")
    while chunk := stream.read(CHUNK):
        yield chunk


def _read_member(
    tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo], name: object, source: str
) -> bytes:
    member = _member(members, name, source)
    if member.size > MAX_DOCUMENT:
        raise ImageError(f"{source}: {name!r} is larger than {MAX_DOCUMENT} bytes")
    return b"".join(_member_chunks(tar, members, name, source))


def _archive_entry(manifest_json: bytes, tag: str | None, source: str) -> dict:
    """The ``manifest.json`` entry of the wanted image (the only one, or the one tagged ``tag``)."""
    try:
        entries = json.loads(manifest_json)
    except ValueError:
        entries = None
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and isinstance(e.get("Config"), str) and isinstance(e.get("Layers"), list)
        for e in entries
    ):
        raise ImageError(f"{source}: manifest.json is not a docker save manifest")
    if tag is not None:
        entries = [e for e in entries if tag in (e.get("RepoTags") or [])]
    if len(entries) != 1:
        raise ImageNotFound(f"{source} holds {len(entries)} images named {tag!r}; name exactly one")
    return entries[0]
