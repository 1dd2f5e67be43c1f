"""Volumes through a gateway with the official SDK's `Volume`: Redis, `aenv scheduler`, one
`aenv gateway` and two real nodes (seeded with the session's `base`, no shared repository). The
volume is made, written and read through the gateway, mounted by sandboxes the gateway places on
the volume's node, read inside them, and deleted; a volume whose node stopped answers 503 with
`Retry-After`."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

import httpx
import pytest

from aenv import devcluster
from aenv.cluster.volumes import CLUSTER_VOLUME_ID
from aenv.devcluster import RedisServer
from aenv.devnode import DevNode
from tests.e2e.conftest import wait_until

pytestmark = pytest.mark.vm

SLOT_FIRST = 2816  # this module's network slots: 2816..2943, apart from every other node the suite starts
SLOT_COUNT = 64


def test_a_volume_through_a_gateway_is_mounted_on_its_node(
    tmp_path: Path, template_seed: Path, redis_session: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from e2b import Sandbox, Volume

    redis_session.flush()
    secret, key = secrets.token_hex(16), "e2b_" + secrets.token_hex(20)
    scheduler = devcluster.scheduler(redis_session.url, tmp_path / "scheduler.log", secret)
    gateway = devcluster.gateway(scheduler.url, tmp_path / "gateway.log", secret, key)
    nodes = [
        DevNode(
            tmp_path / f"node{i}",
            slot_first=SLOT_FIRST + i * SLOT_COUNT,
            slot_count=SLOT_COUNT,
            seed=template_seed,
            warm_pool_size=0,
            scheduler_url=scheduler.url,
            cluster_secret=secret,
            heartbeat_interval=0.5,
            shutdown_action="kill",
        )
        for i in range(2)
    ]
    forced: list[str] = []  # what a node left behind and had to be removed by force
    with contextlib.ExitStack() as stack:
        stack.enter_context(scheduler)
        for node in nodes:
            stack.callback(lambda node=node: forced.extend(node.cleanup()))
            node.start()
        stack.enter_context(gateway)
        api = stack.enter_context(httpx.Client(base_url=gateway.url, headers={"X-API-Key": key}, timeout=300))
        wait_until(lambda: len([n for n in api.get("/nodes").json() if n["status"] == "up"]) == 2, 60,
                   what="both nodes to join")  # fmt: skip
        by_id = {n["id"]: n["address"] for n in api.get("/nodes").json()}
        for name in [n for n in os.environ if n.startswith("E2B_")]:
            monkeypatch.delenv(name)
        for name in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_VOLUME_API_URL"):
            monkeypatch.setenv(name, gateway.url)
        monkeypatch.setenv("E2B_API_KEY", key)

        volume = Volume.create("shared")
        match = CLUSTER_VOLUME_ID.match(volume.volume_id)
        assert match is not None, volume.volume_id
        home = match.group(2)
        volume.write_file("/seed/hello.txt", "through the gateway", force=True)
        assert volume.read_file("/seed/hello.txt") == "through the gateway"
        assert Volume.get_info(volume.volume_id).token == volume.token

        # Placement alone would spread these over both nodes (fewest running first).
        mounting = [
            Sandbox.create("base", timeout=120, volume_mounts={"/mnt/shared": volume}) for _ in range(2)
        ]
        try:
            for sandbox in mounting:
                assert api.get(f"/sandboxes/{sandbox.sandbox_id}").json()["clientID"] == home
                assert sandbox.files.read("/mnt/shared/seed/hello.txt") == "through the gateway"
            mounting[0].files.write("/mnt/shared/from-guest.txt", "written in the guest")
            assert volume.read_file("/from-guest.txt") == "written in the guest"
        finally:
            for sandbox in mounting:
                sandbox.kill()
        Volume.destroy(volume.volume_id)
        assert api.get(f"/volumes/{volume.volume_id}").status_code == 404

        later = Volume.create("later")
        holder = next(n for n in nodes if n.url == by_id[CLUSTER_VOLUME_ID.match(later.volume_id).group(2)])  # type: ignore[union-attr]
        holder.stop()
        away = api.get(f"/volumes/{later.volume_id}")
        assert away.status_code == 503 and away.headers["Retry-After"], away.text
        assert away.json()["code"] == 503 and "retry" in away.json()["message"]
    assert forced == []
