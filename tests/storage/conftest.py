"""Fixtures for the repository contract: a SeaweedFS server per session, a repository factory per backend."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from aenv.devs3 import S3Server, seaweedfs


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture(params=["posix_fs", "s3"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def open_repo(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Callable[..., Any]:
    """Opens a repository instance (one per node) onto one shared store of the chosen backend."""
    from aenv.repository.posix import SnapshotRepository

    if backend == "posix_fs":
        return lambda node="node-a", **options: SnapshotRepository(tmp_path / "repo", node=node, **options)
    from aenv.repository.location import S3Location
    from aenv.repository.s3 import S3Repository

    server: S3Server = request.getfixturevalue("s3_server")
    location = S3Location(
        bucket=server.new_bucket(), prefix=f"t{secrets.token_hex(3)}/repo", endpoint=server.endpoint,
        region=server.region, access_key=server.access_key, secret_key=server.secret_key,
    )  # fmt: skip

    def make(node: str = "node-a", **options: Any) -> S3Repository:
        options.setdefault("part_size", 5 << 20)
        return S3Repository(location, tmp_path / f"staging-{node}", node=node, **options)

    return make
