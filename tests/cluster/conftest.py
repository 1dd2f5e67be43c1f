"""Fixtures for the cluster's tests: one Redis per session, emptied before each test that uses it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from aenv.devcluster import RedisServer, redis_server


@pytest.fixture(scope="session")
def redis_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_url(redis_session: RedisServer) -> str:
    """The URL of an empty Redis database."""
    redis_session.flush()
    return redis_session.url
