"""Test images made by hand: layer tarballs (hostile ones included) and OCI layout directories.

The tests build every image themselves (no Docker Hub): layers are tar streams written with
``tarfile`` (or raw bytes where a hostile header must lie), packed into an OCI image layout that
``skopeo`` can push to the local registry and ``ImageStore.import_oci_layout`` can read.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

from aenv.template.image import OCI_INDEX, OCI_LAYER, OCI_MANIFEST
from aenv.template.store import REF_NAME

Entry = tuple[tarfile.TarInfo, bytes]
MTIME = 1_700_000_000


def _info(name: str, kind: bytes, mode: int, uid: int = 0, gid: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.uid, info.gid = uid, gid
    info.mtime = MTIME
    return info


def file(name: str, data: bytes = b"", mode: int = 0o644, uid: int = 0, gid: int = 0, **pax: str) -> Entry:
    info = _info(name, tarfile.REGTYPE, mode, uid, gid)
    info.size = len(data)
    info.pax_headers = dict(pax)
    return info, data


def directory(name: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> Entry:
    return _info(name, tarfile.DIRTYPE, mode, uid, gid), b""


def symlink(name: str, target: str) -> Entry:
    info = _info(name, tarfile.SYMTYPE, 0o777)
    info.linkname = target
    return info, b""


def hardlink(name: str, target: str) -> Entry:
    info = _info(name, tarfile.LNKTYPE, 0o644)
    info.linkname = target
    return info, b""


def device(name: str, kind: bytes = tarfile.CHRTYPE, major: int = 1, minor: int = 3) -> Entry:
    info = _info(name, kind, 0o666)
    info.devmajor, info.devminor = major, minor
    return info, b""


def fifo(name: str) -> Entry:
    return _info(name, tarfile.FIFOTYPE, 0o644), b""


def layer(*entries: Entry) -> bytes:
    """An uncompressed PAX tar of the entries, in order (duplicates allowed)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def lying_header(name: str, claimed: int, data: bytes) -> bytes:
    """A tar whose one file header claims ``claimed`` bytes but only ``data`` follows, then EOF."""
    info = _info(name, tarfile.REGTYPE, 0o644)
    info.size = claimed
    return info.tobuf(tarfile.PAX_FORMAT) + data


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Layout:
    """An OCI image layout directory being written blob by blob."""

    def __init__(self, path: Path):
        self.path = path
        (path / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        (path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        self.index: list[dict] = []

    def blob(self, data: bytes, media_type: str) -> dict:
        digest = sha256(data)
        (self.path / "blobs" / "sha256" / digest.removeprefix("sha256:")).write_bytes(data)
        return {"mediaType": media_type, "digest": digest, "size": len(data)}

    def image(
        self, layers: list[bytes], config: dict | None = None, *, arch: str = "amd64", compress: bool = True
    ) -> dict:
        """Store an image (layers as uncompressed tars) and return its manifest's descriptor."""
        descriptors = [
            self.blob(gzip.compress(tar, mtime=0), OCI_LAYER + "+gzip")
            if compress
            else self.blob(tar, OCI_LAYER)
            for tar in layers
        ]
        document = {
            "architecture": arch,
            "os": "linux",
            "config": config or {},
            "rootfs": {"type": "layers", "diff_ids": [sha256(tar) for tar in layers]},
        }
        config_descriptor = self.blob(
            json.dumps(document).encode(), "application/vnd.oci.image.config.v1+json"
        )
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": config_descriptor,
            "layers": descriptors,
        }
        descriptor = self.blob(json.dumps(manifest).encode(), OCI_MANIFEST)
        descriptor["platform"] = {"architecture": arch, "os": "linux"}
        return descriptor

    def multi_platform(self, manifests: list[dict]) -> dict:
        index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests}
        return self.blob(json.dumps(index).encode(), OCI_INDEX)

    def tag(self, descriptor: dict, name: str) -> None:
        self.index.append({**descriptor, "annotations": {REF_NAME: name}})
        index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": self.index}
        (self.path / "index.json").write_text(json.dumps(index))


def single_image(path: Path, layers: list[bytes], config: dict | None = None, tag: str = "latest") -> Path:
    """An OCI layout holding one linux/amd64 image tagged ``tag``."""
    layout = Layout(path)
    layout.tag(layout.image(layers, config), tag)
    return path
