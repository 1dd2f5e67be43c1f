"""The storage settings contract: AENV_REPOSITORY, AENV_S3_*, AENV_CACHE_CAPACITY_MIB."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.config import ConfigError, load_settings
from aenv.repository.posix import SnapshotRepository
from aenv.runtime.open import open_storage


def test_no_settings_keep_the_posix_repository_under_home(tmp_path: Path):
    settings = load_settings({"AENV_HOME_PATH": str(tmp_path)})
    assert settings.repository == "" and settings.cache_capacity_mib > 0
    storage = open_storage(settings, "node-a")
    try:
        assert isinstance(storage.repository, SnapshotRepository) and storage.runtime is None
        assert storage.repository.root == tmp_path / "repository"
    finally:
        storage.heartbeat.stop()


def test_a_directory_repository(tmp_path: Path):
    settings = load_settings({"AENV_HOME_PATH": str(tmp_path), "AENV_REPOSITORY": str(tmp_path / "shared")})
    storage = open_storage(settings, "node-a")
    storage.heartbeat.stop()
    assert storage.repository.root == tmp_path / "shared"


def test_s3_settings_are_read_and_checked():
    settings = load_settings(
        {
            "AENV_REPOSITORY": "s3://bucket/some/prefix",
            "AENV_S3_ENDPOINT": "http://127.0.0.1:8333",
            "AENV_S3_REGION": "eu-west-1",
            "AENV_CACHE_CAPACITY_MIB": "512",
        }
    )
    assert (settings.s3_endpoint, settings.s3_region, settings.cache_capacity_mib) == (
        "http://127.0.0.1:8333", "eu-west-1", 512,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="AENV_S3_REGION"):
        load_settings({"AENV_REPOSITORY": "s3://bucket/prefix"})
    with pytest.raises(ConfigError, match="s3://BUCKET"):
        load_settings({"AENV_REPOSITORY": "s3:///prefix", "AENV_S3_REGION": "x"})
    with pytest.raises(ConfigError, match="directory or s3"):
        load_settings({"AENV_REPOSITORY": "gs://bucket"})
    with pytest.raises(ConfigError, match="cache_capacity_mib"):
        load_settings({"AENV_CACHE_CAPACITY_MIB": "0"})


def test_aws_variables_are_the_credentials(s3_server, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    settings = load_settings(
        {
            "AENV_HOME_PATH": str(tmp_path),
            "AENV_REPOSITORY": f"s3://{s3_server.new_bucket()}/aenv",
            "AENV_S3_ENDPOINT": s3_server.endpoint,
            "AENV_S3_REGION": s3_server.region,
        }
    )
    storage = open_storage(settings, "node-a")
    storage.close()
    assert storage.lazy is not None  # its server read the same variables
    digest = storage.repository.put_bytes(b"signed with the AWS variables")
    assert storage.repository.has_blob(digest)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(Exception, match=r"SignatureDoesNotMatch|Forbidden|403"):
        open_storage(settings, "node-b")


def test_s3_urls_name_bucket_and_prefix():
    from aenv.repository.location import S3Location

    location = S3Location.from_url("s3://bucket/a/b/", region="r")
    assert (location.bucket, location.prefix, location.region) == ("bucket", "a/b", "r")
    assert S3Location.from_url("s3://bucket").prefix == ""
    with pytest.raises(ValueError, match="s3://BUCKET"):
        S3Location.from_url("s3:///x")


def test_p2p_is_off_by_default_and_its_peers_are_urls():
    assert not load_settings({}).p2p
    settings = load_settings({"AENV_P2P": "true", "AENV_P2P_PEERS": " http://10.0.0.6:8000/, https://b:1 ,"})
    assert settings.p2p and settings.peer_urls == ["http://10.0.0.6:8000", "https://b:1"]
    with pytest.raises(ConfigError, match="p2p_peers"):
        load_settings({"AENV_P2P_PEERS": "10.0.0.6:8000"})
