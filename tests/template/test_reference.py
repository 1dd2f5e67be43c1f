"""References, loopback detection and auth challenges are parsed as Docker does."""

from __future__ import annotations

import pytest

from aenv.template import InvalidReference
from aenv.template.reference import Reference, is_loopback, parse_reference
from aenv.template.registry import parse_challenge

DIGEST = "sha256:" + "a" * 64


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ubuntu", Reference("docker.io", "library/ubuntu", "latest")),
        ("ubuntu:22.04", Reference("docker.io", "library/ubuntu", "22.04")),
        ("e2bdev/code-interpreter", Reference("docker.io", "e2bdev/code-interpreter", "latest")),
        ("ghcr.io/org/app:v1", Reference("ghcr.io", "org/app", "v1")),
        ("localhost/app", Reference("localhost", "app", "latest")),
        ("127.0.0.1:5000/a/b:t", Reference("127.0.0.1:5000", "a/b", "t")),
        ("[::1]:5000/a", Reference("[::1]:5000", "a", "latest")),
        (f"reg.example:443/app@{DIGEST}", Reference("reg.example:443", "app", None, DIGEST)),
        (f"app:v1@{DIGEST}", Reference("docker.io", "library/app", "v1", DIGEST)),
    ],
)
def test_parse_reference(text: str, expected: Reference) -> None:
    assert parse_reference(text) == expected


def test_docker_hub_api_host_and_ref() -> None:
    ref = parse_reference(f"python@{DIGEST}")
    assert (ref.api_host, ref.ref, str(ref)) == (
        "registry-1.docker.io",
        DIGEST,
        f"docker.io/library/python@{DIGEST}",
    )


@pytest.mark.parametrize(
    "text",
    [
        "",
        "UPPER/case",
        "a//b",
        "app:",
        "app:-bad",
        "app@sha256:short",
        "app@md5:" + "a" * 32,
        "x" * 300,
        "a/../b",
    ],
)
def test_invalid_references(text: str) -> None:
    with pytest.raises(InvalidReference) as refused:
        parse_reference(text)
    assert refused.value.status == 400


@pytest.mark.parametrize(
    ("registry", "loopback"),
    [
        ("localhost:5000", True),
        ("127.0.0.1:5000", True),
        ("127.1.2.3", True),
        ("[::1]:5000", True),
        ("docker.io", False),
        ("10.0.0.1:5000", False),
        ("localhost.example.com", False),
    ],
)
def test_is_loopback(registry: str, loopback: bool) -> None:
    assert is_loopback(registry) is loopback


def test_parse_challenge() -> None:
    header = (
        'Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:a/b:pull"'
    )
    assert parse_challenge(header) == (
        "bearer",
        {
            "realm": "https://auth.docker.io/token",
            "service": "registry.docker.io",
            "scope": "repository:a/b:pull",
        },
    )
    assert parse_challenge('Basic realm="Registry Realm"') == ("basic", {"realm": "Registry Realm"})
