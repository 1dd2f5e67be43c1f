"""Pulling from a real registry (Debian's docker-registry on loopback): anonymous, basic, bearer.

Images are pushed by skopeo from OCI layouts the tests write; a proxy in front of the registry
lies about digests and sizes to prove such registries are refused and nothing unverified is kept.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.template import (
    Credentials,
    ImageNotFound,
    ImageStore,
    IntegrityError,
    RegistryAuthError,
    RegistryError,
    UnsupportedImage,
)
from aenv.template.image import DOCKER_MANIFEST, OCI_LAYER, sha256_digest
from tests.template.conftest import PASSWORD, USER, Proxy, Registry
from tests.template.images import EXPECTED, check_tree, unpacked, write_test_layout


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_test_layout(tmp_path_factory.mktemp("layout") / "oci")


@pytest.fixture(scope="module")
def pushed(registry: Registry, layout: Path) -> Registry:
    registry.push(layout, "multi", "test/multi:v1", all_platforms=True)
    registry.push(layout, "single", "test/docker:v1", docker=True)
    registry.push(layout, "armonly", "test/arm:v1")
    return registry


def test_pull_index_picks_linux_amd64(pushed: Registry, tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    image = store.pull(f"{pushed.host}/test/multi:v1")
    assert image.config == EXPECTED
    assert image.reference == f"{pushed.host}/test/multi:v1"
    assert [layer.media_type for layer in image.layers] == [OCI_LAYER + "+gzip"] * 2
    assert sha256_digest(store.blob_path(image.digest).read_bytes()) == image.digest
    check_tree(unpacked(image, tmp_path / "scratch"))
    pinned = store.pull(f"{pushed.host}/test/multi@{image.digest}")
    assert (pinned.digest, pinned.config_digest, pinned.layers) == (
        image.digest,
        image.config_digest,
        image.layers,
    )


def test_pull_docker_schema2(pushed: Registry, tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    image = store.pull(f"{pushed.host}/test/docker:v1")
    manifest = store.blob_path(image.digest).read_text()
    assert DOCKER_MANIFEST in manifest
    assert all(
        layer.media_type == "application/vnd.docker.image.rootfs.diff.tar.gzip" for layer in image.layers
    )
    assert image.config == EXPECTED
    check_tree(unpacked(image, tmp_path / "scratch"))


def test_missing_image_and_other_platforms(pushed: Registry, tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    with pytest.raises(ImageNotFound) as missing:
        store.pull(f"{pushed.host}/test/none:v1")
    assert missing.value.status == 404
    with pytest.raises(ImageNotFound):
        store.pull(f"{pushed.host}/test/multi:v2")
    with pytest.raises(UnsupportedImage, match="linux/arm64, not linux/amd64"):
        store.pull(f"{pushed.host}/test/arm:v1")


def test_stored_blobs_are_not_fetched_again(pushed: Registry, proxy: Proxy, tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    first = store.pull(f"{proxy.host}/test/multi:v1")
    assert sum("/blobs/" in p for p in proxy.paths) == 3  # config and two layers
    proxy.paths.clear()
    second = store.pull(f"{proxy.host}/test/multi:v1")
    assert second.layers == first.layers
    assert not any("/blobs/" in p for p in proxy.paths)
    assert proxy.paths  # the tag is still resolved by the registry


def _corrupt(path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], bytes]:
    if "/blobs/" in path:
        body = bytes([body[0] ^ 0xFF]) + body[1:]
    return 200, headers, body


def _longer(path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], bytes]:
    return 200, headers, body + b"\0" * 4096 if "/blobs/" in path else body


def _shorter(path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], bytes]:
    return 200, headers, body[:-7] if "/blobs/" in path else body


def _wrong_manifest_digest(
    path: str, headers: dict[str, str], body: bytes
) -> tuple[int, dict[str, str], bytes]:
    if "/manifests/" in path:
        headers = {**headers, "Docker-Content-Digest": sha256_digest(b"something else")}
    return 200, headers, body


def _other_manifest(path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], bytes]:
    if "/manifests/sha256:" in path:  # the platform manifest asked for by digest, answered with another
        body = body.replace(b'"size":', b'"size": ', 1)
        headers = {k: v for k, v in headers.items() if k.lower() != "docker-content-digest"}
    return 200, headers, body


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (_corrupt, "hashing to"),
        (_longer, "sent more than"),
        (_shorter, "which declares"),
        (_wrong_manifest_digest, "claims manifest"),
        (_other_manifest, "when asked for manifest"),
    ],
)
def test_lying_registry_is_refused(
    pushed: Registry, proxy: Proxy, tmp_path: Path, tamper, message: str
) -> None:
    store = ImageStore(tmp_path / "store")
    proxy.tamper = tamper
    with pytest.raises(IntegrityError, match=message) as refused:
        store.pull(f"{proxy.host}/test/multi:v1")
    assert refused.value.status == 502
    assert not list((tmp_path / "store" / "tmp").iterdir())
    for blob in (tmp_path / "store" / "blobs" / "sha256").iterdir():  # only verified blobs were kept
        assert sha256_digest(blob.read_bytes()) == f"sha256:{blob.name}"


def test_plain_http_token_service_off_loopback_is_refused(
    pushed: Registry, proxy: Proxy, tmp_path: Path
) -> None:
    def challenge(path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], bytes]:
        return 401, {"WWW-Authenticate": 'Bearer realm="http://192.0.2.1/token",service="x"'}, b"{}"

    proxy.tamper = challenge
    with pytest.raises(RegistryError, match="plain HTTP"):
        ImageStore(tmp_path / "store").pull(f"{proxy.host}/test/multi:v1")


@pytest.mark.parametrize("kind", ["basic_registry", "token_registry"])
def test_pull_with_credentials(
    kind: str, request: pytest.FixtureRequest, layout: Path, tmp_path: Path
) -> None:
    private: Registry = request.getfixturevalue(kind)
    private.push(layout, "multi", "private/app:v1", all_platforms=True)
    store = ImageStore(tmp_path / "store")
    reference = f"{private.host}/private/app:v1"
    with pytest.raises(RegistryAuthError) as anonymous:
        store.pull(reference)
    assert anonymous.value.status == 401
    with pytest.raises(RegistryAuthError):
        store.pull(reference, Credentials(USER, "wrong"))
    image = store.pull(reference, Credentials(USER, PASSWORD))
    assert image.config == EXPECTED
    check_tree(unpacked(image, tmp_path / "scratch"))
    if kind == "token_registry":
        last = private.token_requests[-1]
        assert last == {"scope": ["repository:private/app:pull"], "service": ["aenv-test-registry"]}


def test_oci_layout_and_docker_archive_made_by_skopeo(pushed: Registry, tmp_path: Path) -> None:
    """The same image from a registry, an OCI layout and ``docker save`` format is the same image."""
    store = ImageStore(tmp_path / "store")
    pulled = store.pull(f"{pushed.host}/test/multi:v1")
    pushed.copy_out("test/multi:v1", f"oci:{tmp_path / 'layout'}:exported")
    pushed.copy_out("test/multi:v1", f"docker-archive:{tmp_path / 'saved.tar'}:example.org/saved:v1")
    from_layout = ImageStore(tmp_path / "store2").import_oci_layout(tmp_path / "layout", "exported")
    from_archive = ImageStore(tmp_path / "store3").import_docker_archive(tmp_path / "saved.tar")
    assert from_archive.reference == "example.org/saved:v1"
    for image in (from_layout, from_archive):
        assert image.config_digest == pulled.config_digest
        assert image.config == EXPECTED
    assert from_layout.digest == pulled.digest
    check_tree(unpacked(from_layout, tmp_path / "s1"))
    check_tree(unpacked(from_archive, tmp_path / "s2"))
    with pytest.raises(ImageNotFound):
        ImageStore(tmp_path / "store4").import_oci_layout(tmp_path / "layout", "nope")
