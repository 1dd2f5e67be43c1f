"""Volumes through a gateway, without VMs: the gateway's real app over a fake scheduler and two
nodes serving their real volume API on real `VolumeStore`s (ext4 images). A sandbox that mounts
a volume is placed on the volume's node. (With real nodes, VMs and the SDK: test_volumes_vm.py.)"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from aenv.api import schemas
from aenv.api.server import NodeAPI
from aenv.cluster.gateway import gateway_app
from aenv.cluster.model import NodeState
from aenv.cluster.volumes import CLUSTER_VOLUME_ID, RETRY_AFTER
from aenv.config import Settings
from aenv.volumes.store import GUEST_IDS, IdRange, VolumeStore
from tests.cluster.fakes import FakeNode, FakeScheduler, manifest, node_info

pytestmark = pytest.mark.asyncio(loop_scope="session")

SECRET = "cluster-secret-for-tests"
KEY = "e2b_gateway_key"
SETTINGS = Settings(cluster_secret=SECRET, gateway_addr="127.0.0.1:8080")
BASE = manifest("base1", "2026-01-01T00:00:00+00:00", alias="base")
IDS = IdRange(1_900_000_000, GUEST_IDS)


@dataclass
class Cluster:
    scheduler: FakeScheduler
    stores: dict[str, VolumeStore]
    servers: dict[str, TestServer]
    gateway: httpx.AsyncClient

    async def kill(self, node_id: str) -> None:
        await self.servers.pop(node_id).close()
        self.scheduler.set_status(node_id, NodeState.DOWN)

    async def volume(self, name: str) -> dict:
        created = await self.gateway.post("/volumes", json={"name": name, "sizeMiB": 16})
        assert created.status_code == 201, created.text
        return created.json()


async def serve(app: web.Application) -> TestServer:
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    scheduler = FakeScheduler()
    gateway = await serve(gateway_app(scheduler, SETTINGS, KEY))
    stores, servers = {}, {}
    for node_id in ("na", "nb"):
        stores[node_id] = store = VolumeStore(tmp_path / node_id, IDS, 16)
        node = FakeNode(node_id, [BASE])
        api = NodeAPI(node, domain="localhost:1", limits=schemas.limits(SETTINGS), volumes=store)  # type: ignore[arg-type]
        servers[node_id] = server = await serve(api.app("e2b_node_key", SECRET))
        await scheduler.register(node_info(node_id, str(server.make_url("")).rstrip("/")))
    async with httpx.AsyncClient(base_url=str(gateway.make_url("")), headers={"X-API-Key": KEY}) as client:
        yield Cluster(scheduler, stores, servers, client)
    for server in [gateway, *servers.values()]:
        await server.close()
    for store in stores.values():
        store.close()


async def test_volumes_live_on_a_node_and_sandboxes_mounting_them_are_placed_there(cluster: Cluster) -> None:
    volumes = [await cluster.volume(f"data-{i}") for i in range(4)]
    homes = {v["name"]: CLUSTER_VOLUME_ID.match(v["volumeID"]).group(2) for v in volumes}  # type: ignore[union-attr]
    assert set(homes.values()) == {"na", "nb"}, homes  # spread by name over the nodes
    for name, node_id in homes.items():
        assert cluster.stores[node_id].by_name(name) is not None
    taken = await cluster.gateway.post("/volumes", json={"name": "data-0"})
    assert taken.status_code == 409 and taken.json()["code"] == 409  # names are the cluster's
    listed = (await cluster.gateway.get("/volumes")).json()
    assert sorted(v["volumeID"] for v in listed) == sorted(v["volumeID"] for v in volumes)

    volume = volumes[0]
    content = f"/volumecontent/{volume['volumeID']}"
    bearer = {"Authorization": f"Bearer {volume['token']}", "X-API-Key": ""}  # the token, no API key
    written = await cluster.gateway.put(f"{content}/file", params={"path": "/a/b.txt", "force": "true"},
                                        content=b"x" * 300_000, headers=bearer)  # fmt: skip
    assert written.status_code == 201, written.text
    read = await cluster.gateway.get(f"{content}/file", params={"path": "/a/b.txt"}, headers=bearer)
    assert read.status_code == 200 and read.content == b"x" * 300_000
    entries = (
        await cluster.gateway.get(f"{content}/dir", params={"path": "/", "depth": 2}, headers=bearer)
    ).json()
    assert [e["path"] for e in entries] == ["/a", "/a/b.txt"]
    wrong = await cluster.gateway.get(
        f"{content}/file", params={"path": "/a/b.txt"}, headers={"X-API-Key": ""}
    )
    assert wrong.status_code == 403  # the node checks the token
    assert (await cluster.gateway.get(f"/volumes/{volume['volumeID']}")).json() == volume

    create = {"templateID": "base1", "volumeMounts": [{"name": volume["name"], "path": "/mnt/v"}]}
    for _ in range(3):  # the fake scheduler spreads the rest by load: these all go home
        sandbox = await cluster.gateway.post("/sandboxes", json=create)
        assert sandbox.status_code == 201, sandbox.text
        assert cluster.scheduler.bound[sandbox.json()["sandboxID"]].node_id == homes[volume["name"]]
    other = next(v["name"] for v in volumes if homes[v["name"]] != homes[volume["name"]])
    both = {
        "templateID": "base1",
        "volumeMounts": [*create["volumeMounts"], {"name": other, "path": "/mnt/w"}],
    }
    split = await cluster.gateway.post("/sandboxes", json=both)
    assert split.status_code == 400 and "one node" in split.json()["message"]
    missing = await cluster.gateway.post(
        "/sandboxes", json=create | {"volumeMounts": [{"name": "nope", "path": "/m"}]}
    )
    assert missing.status_code == 400 and "'nope'" in missing.json()["message"]

    assert (await cluster.gateway.delete(f"/volumes/{volume['volumeID']}")).status_code == 204
    assert cluster.stores[homes[volume["name"]]].by_name(volume["name"]) is None
    gone = await cluster.gateway.get(f"/volumes/{volume['volumeID']}")
    assert gone.status_code == 404 and gone.json()["code"] == 404
    assert (await cluster.gateway.get("/volumes/vol-not-one")).status_code == 404


async def test_a_volume_whose_node_is_down_answers_a_retryable_error(cluster: Cluster) -> None:
    volumes = [await cluster.volume(f"data-{i}") for i in range(4)]
    on_nb = [v for v in volumes if v["volumeID"].endswith("-nb")]
    await cluster.kill("nb")
    for path in (f"/volumes/{on_nb[0]['volumeID']}", f"/volumecontent/{on_nb[0]['volumeID']}/dir?path=/"):
        answer = await cluster.gateway.get(path, headers={"Authorization": f"Bearer {on_nb[0]['token']}"})
        assert answer.status_code == 503 and answer.headers["Retry-After"] == str(RETRY_AFTER), answer.text
        assert answer.json()["error_code"] == "volume_node_down" and "nb" in answer.json()["message"]
    create = {"templateID": "base1", "volumeMounts": [{"name": on_nb[0]["name"], "path": "/mnt/v"}]}
    placed = await cluster.gateway.post("/sandboxes", json=create)
    assert placed.status_code == 503 and "nb" in placed.json()["message"]  # not a 400: it may be there
    again = await cluster.gateway.post("/volumes", json={"name": on_nb[0]["name"]})
    assert again.status_code == 503 and again.headers["Retry-After"]  # the name may be taken on nb
    listed = (await cluster.gateway.get("/volumes")).json()
    assert sorted(v["volumeID"] for v in listed) == sorted(v["volumeID"] for v in volumes if v not in on_nb)
