"""A killed sandbox's durable pause discarded from a real S3 repository (SeaweedFS), no VM.

Its node is down and may never come back, so a node of the cluster deletes the pause: through
the node's real API route and service (`NodeService.discard_pause`), over a bucket where the
pausing node committed the pause (committed here directly through the repository API) and where
other nodes may claim it first. A node whose repository is its own (posix) says it cannot help.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from aiohttp.test_utils import TestServer

from aenv.api import schemas
from aenv.api.server import NodeAPI
from aenv.config import Settings
from aenv.devs3 import S3Server
from aenv.orchestrator.errors import NOT_SHARED
from aenv.orchestrator.housekeeping import Housekeeper
from aenv.orchestrator.local import LocalNode
from aenv.orchestrator.service import Orchestrator
from aenv.orchestrator.store import SandboxStore
from aenv.repository.errors import SnapshotNotFound
from aenv.repository.manifest import SnapshotManifest
from aenv.repository.s3 import S3Repository
from aenv.runtime.open import Storage, open_storage
from aenv.snapshot.engine import SnapshotEngine
from aenv.snapshot.handover import PAUSE_MARK, pause_alias
from aenv.vmm.accel import accelerator_from_env
from tests.storage.test_repository_contract import manifest_of

pytestmark = pytest.mark.asyncio(loop_scope="session")

KEY = "e2b_" + "1f" * 20


@contextlib.asynccontextmanager
async def node_client(
    settings: Settings, node: str, artifacts
) -> AsyncIterator[tuple[httpx.AsyncClient, Storage]]:
    """A node's API on a loopback port, over the node service `aenv server` runs (no VM is started)."""
    storage = open_storage(settings, node)
    engine = SnapshotEngine(
        settings.home_path, storage.repository, artifacts, accelerator_from_env().accel,
        runtime=storage.runtime, durable_pauses=storage.repository.shared,
    )  # fmt: skip
    orchestrator = Orchestrator(settings, engine, SandboxStore(settings.home_path / "node.db"))
    service = LocalNode(orchestrator, Housekeeper(engine, settings.gc_interval), node)
    api = NodeAPI(service, domain="localhost:1", limits=schemas.limits(settings))
    server = TestServer(api.app(KEY), host="127.0.0.1")
    await server.start_server()
    try:
        async with httpx.AsyncClient(base_url=str(server.make_url("")), headers={"X-API-Key": KEY}) as client:
            yield client, storage
    finally:
        await server.close()
        await engine.close()
        storage.close()


@pytest.fixture
async def bucket_node(s3_server: S3Server, tmp_path: Path, guest_artifacts):
    """Node b of a cluster sharing a bucket (its API, its repository) and the bucket as other nodes see it."""
    url = f"s3://{s3_server.new_bucket()}/cluster"
    settings = Settings(
        home_path=tmp_path / "b", repository=url, s3_endpoint=s3_server.endpoint, s3_region=s3_server.region,
        s3_access_key=s3_server.access_key, s3_secret_key=s3_server.secret_key, lazy_loading=False,
    ).validate()  # fmt: skip
    async with node_client(settings, "node-b", guest_artifacts) as (client, storage):
        assert isinstance(storage.repository, S3Repository)
        location = storage.repository.location
        yield client, storage.repository, lambda node: S3Repository(location, tmp_path / node, node=node)


def paused(repo: S3Repository, sandbox_id: str) -> SnapshotManifest:
    """The pause snapshot the sandbox's node committed when it paused it."""
    manifest = manifest_of(repo, sandbox_id, alias=pause_alias(sandbox_id))
    manifest = dataclasses.replace(manifest, metadata={PAUSE_MARK: sandbox_id})
    repo.commit(manifest)
    return manifest


async def test_a_killed_pause_is_claimed_then_deleted_with_its_blobs(bucket_node) -> None:
    client, _, other = bucket_node
    node_a = other("node-a")  # the pausing node, down
    pause = paused(node_a, "killedsbx1")
    assert (await client.delete("/sandboxes/killedsbx1/pause")).status_code == 204
    with pytest.raises(SnapshotNotFound):
        node_a.get(pause_alias("killedsbx1"))
    node_a.gc(grace_seconds=0)
    assert not any(node_a.has_blob(digest) for digest in pause.blobs())  # nothing keeps them now
    gone = await client.delete("/sandboxes/killedsbx1/pause")
    assert gone.status_code == 404 and "no durable pause" in gone.json()["message"]


async def test_a_pause_claimed_elsewhere_first_is_left_to_its_claimant(bucket_node) -> None:
    """A take-over under way on node c (or node a back, resuming or killing it) claimed it first."""
    client, _, other = bucket_node
    node_c = other("node-c")
    pause = paused(other("node-a"), "claimedsbx1")
    assert node_c.claim(pause.id) == "node-c"
    refused = await client.delete("/sandboxes/claimedsbx1/pause")
    assert refused.status_code == 409 and "node-c" in refused.json()["message"], refused.text
    assert node_c.get(pause_alias("claimedsbx1")).id == pause.id and node_c.claimant(pause.id) == "node-c"


async def test_a_failed_delete_gives_the_claim_back(bucket_node, monkeypatch: pytest.MonkeyPatch) -> None:
    """So the pausing node, back, claims it for its own kill, which removes it then."""
    client, repository, other = bucket_node
    node_a = other("node-a")
    pause = paused(node_a, "failedsbx1")

    def store_away(*args: object, **kwargs: object) -> bool:
        raise ConnectionError("the store does not answer")

    monkeypatch.setattr(repository, "delete", store_away)
    failed = await client.delete("/sandboxes/failedsbx1/pause")
    assert failed.status_code == 500 and "the store does not answer" in failed.json()["message"]
    assert node_a.claimant(pause.id) is None and node_a.claim(pause.id) == "node-a"


async def test_a_node_with_its_own_repository_cannot_discard(tmp_path: Path, guest_artifacts) -> None:
    settings = Settings(home_path=tmp_path / "p").validate()
    async with node_client(settings, "node-p", guest_artifacts) as (client, _):
        refused = await client.delete("/sandboxes/anysbx1/pause")
        assert refused.status_code == 409 and refused.json()["error_code"] == NOT_SHARED, refused.text
