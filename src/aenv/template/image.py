"""What an OCI/Docker image is to aenv: validated manifest documents and the pulled ``Image``.

Registries, OCI layout directories and ``docker save`` tarballs all describe an image with the
same few JSON documents (index, manifest, config). They are parsed here with pydantic so that a
malformed or hostile document fails with one clear ``ImageError`` instead of a ``KeyError``
deep inside a build, and so every source ends in the same ``Image`` value.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
# Compression is detected from the bytes when unpacking; the media type only has to be a layer.
LAYER_TYPES = (
    OCI_LAYER,
    OCI_LAYER + "+gzip",
    OCI_LAYER + "+zstd",
    "application/vnd.docker.image.rootfs.diff.tar",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
)
PLATFORM = ("linux", "amd64")
MAX_DOCUMENT = 4 << 20  # manifests and configs are a few KiB; refuse anything absurd


class ImageError(Exception):
    """An image cannot be had or used; ``status`` is the HTTP status an API answers with."""

    status = 400


class InvalidReference(ImageError):
    """The image reference does not follow the Docker reference grammar."""


class ImageNotFound(ImageError):
    """The registry or archive has no such repository, tag or digest."""

    status = 404


class RegistryAuthError(ImageError):
    """The registry asks for credentials that were not given or that it refused."""

    status = 401


class RegistryError(ImageError):
    """The registry is unreachable, answered with an error, or sent malformed documents."""

    status = 502


class IntegrityError(RegistryError):
    """Bytes do not match the digest or size that names them: the source lies or is corrupt."""


class UnsupportedImage(ImageError):
    """A valid image aenv cannot run: other platform, schema 1, foreign layers."""


class LayerRefused(ImageError):
    """A layer tarball is malformed or hostile (escaping paths, truncated data, too large)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=True)


class Platform(_Model):
    architecture: str
    os: str
    variant: str | None = None


class Descriptor(_Model):
    media_type: str = Field(alias="mediaType")
    digest: str = Field(pattern=DIGEST_PATTERN)
    size: int = Field(ge=0)
    platform: Platform | None = None
    urls: list[str] | None = None
    annotations: dict[str, str] | None = None


class Manifest(_Model):
    schema_version: Literal[2] = Field(alias="schemaVersion")
    media_type: str | None = Field(default=None, alias="mediaType")
    config: Descriptor
    layers: list[Descriptor]


class Index(_Model):
    schema_version: Literal[2] = Field(alias="schemaVersion")
    media_type: str | None = Field(default=None, alias="mediaType")
    manifests: list[Descriptor]


class RuntimeConfig(_Model):
    env: list[str] | None = Field(default=None, alias="Env")
    user: str | None = Field(default=None, alias="User")
    working_dir: str | None = Field(default=None, alias="WorkingDir")
    entrypoint: list[str] | None = Field(default=None, alias="Entrypoint")
    cmd: list[str] | None = Field(default=None, alias="Cmd")


class RootFS(_Model):
    type: Literal["layers"]
    diff_ids: list[str] = Field(alias="diff_ids")


class ConfigDocument(_Model):
    architecture: str
    os: str
    config: RuntimeConfig | None = None
    rootfs: RootFS


M = TypeVar("M", bound=_Model)


def parse_document(model: type[M], data: bytes, what: str) -> M:
    """Validate a JSON document; a malformed one raises ``RegistryError`` naming ``what``."""
    try:
        return model.model_validate(json.loads(data))
    except (ValueError, ValidationError) as exc:
        raise RegistryError(f"{what} is not a valid {model.__name__.lower()}: {exc}") from None


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def document_type(data: bytes, declared: str | None) -> str:
    """The media type of a manifest or index: its own ``mediaType`` field, else what was declared."""
    try:
        document = json.loads(data)
    except ValueError:
        document = None
    if not isinstance(document, dict):
        raise RegistryError("manifest is not a JSON object")
    if document.get("schemaVersion") == 1:
        raise UnsupportedImage("Docker schema 1 manifests are not supported; push the image again")
    media_type = document.get("mediaType") or (declared or "").split(";")[0].strip()
    if isinstance(media_type, str) and media_type and media_type != "application/json":
        return media_type
    # OCI allows both documents without mediaType; their keys tell them apart.
    return OCI_INDEX if "manifests" in document else OCI_MANIFEST


def select_platform(index: Index) -> Descriptor:
    """The linux/amd64 manifest of an index (without a variant preferred, as Docker does)."""
    candidates = [
        d
        for d in index.manifests
        if d.platform is not None and (d.platform.os, d.platform.architecture) == PLATFORM
    ]
    if not candidates:
        offered = sorted(
            {f"{d.platform.os}/{d.platform.architecture}" for d in index.manifests if d.platform}
        )
        raise UnsupportedImage(f"the image has no {'/'.join(PLATFORM)} variant (it offers {offered})")
    return min(candidates, key=lambda d: d.platform is not None and d.platform.variant not in (None, "v1"))


@dataclass(frozen=True)
class ImageConfig:
    """The parts of an image's config a sandbox needs: how its processes start by default."""

    env: tuple[str, ...] = ()
    user: str = ""
    working_dir: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()

    @classmethod
    def from_document(cls, document: ConfigDocument) -> ImageConfig:
        c = document.config or RuntimeConfig()
        return cls(
            env=tuple(c.env or ()),
            user=c.user or "",
            working_dir=c.working_dir or "",
            entrypoint=tuple(c.entrypoint or ()),
            cmd=tuple(c.cmd or ()),
        )

    @property
    def env_vars(self) -> dict[str, str]:
        """``Env`` as a mapping (a later ``K=`` wins, as in Docker)."""
        return dict(entry.partition("=")[::2] for entry in self.env)

    @property
    def command(self) -> tuple[str, ...]:
        """What Docker would run with no arguments: ``Entrypoint`` followed by ``Cmd``."""
        return self.entrypoint + self.cmd


@dataclass(frozen=True)
class Layer:
    """One filesystem layer: its stored blob and the digest of its uncompressed tar."""

    digest: str
    size: int
    media_type: str
    diff_id: str
    path: Path


@dataclass(frozen=True)
class Image:
    """A pulled or imported image whose blobs are all verified and stored locally.

    ``digest`` is the manifest's digest (what ``name@digest`` pins); ``config_digest`` is the
    image ID, equal for the same image from a registry, an OCI layout or ``docker save``, so
    derived artifacts are keyed by it.
    """

    reference: str
    digest: str
    config_digest: str
    config: ImageConfig
    layers: tuple[Layer, ...]
