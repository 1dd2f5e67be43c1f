"""A real node in a cluster: `aenv server` with AENV_SCHEDULER_URL registers with a real
scheduler, heartbeats, and binds the sandbox it creates and unbinds it when it is killed."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.devnode import DevNode

from .processes import scheduler_process

pytestmark = pytest.mark.vm
SLOT_FIRST = 15872  # apart from every other node the suite starts


def until(read: Callable[[], Any], holds: Callable[[Any], bool], timeout: float = 120.0) -> Any:
    """Poll `read()` until its value satisfies `holds`; returns that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if holds(value):
            return value
        assert time.monotonic() < deadline, f"still {value!r}"
        time.sleep(0.2)


def test_a_node_registers_heartbeats_and_binds_its_sandboxes(
    redis_url: str, template_seed: Path, tmp_path: Path
) -> None:
    with scheduler_process(redis_url, tmp_path / "scheduler.log") as url:
        scheduler = httpx.Client(base_url=url)
        node = DevNode(
            tmp_path / "home", slot_first=SLOT_FIRST, slot_count=64, seed=template_seed,
            warm_pool_size=0, scheduler_url=url, heartbeat_interval=0.5,
        )  # fmt: skip
        with node, scheduler:
            (joined,) = until(lambda: scheduler.get("/nodes").json(), lambda nodes: len(nodes) == 1)
            assert (joined["address"], joined["status"]) == (node.url, "up")
            assert joined["capacity"]["memory_mib"] > 0 and "base" in joined["cached"]
            path = f"/nodes/{joined['node_id']}"
            until(lambda: scheduler.get(path).json()["heartbeat_at"], lambda at: at > joined["heartbeat_at"])

            api = httpx.Client(base_url=node.url, headers={"X-API-Key": node.key}, timeout=300)
            with api:
                created = api.post("/sandboxes", json={"templateID": "base", "timeout": 120})
                assert created.status_code == 201, created.text
                sandbox_id = created.json()["sandboxID"]
                bindings = f"/bindings?node_id={joined['node_id']}"
                (bound,) = until(lambda: scheduler.get(bindings).json(), lambda found: len(found) == 1)
                assert (bound["sandbox_id"], bound["state"], bound["durable"]) == (
                    sandbox_id,
                    "running",
                    False,
                )
                assert scheduler.get(f"/bindings/{sandbox_id}").json()["node"]["address"] == node.url
                assert api.delete(f"/sandboxes/{sandbox_id}").status_code == 204
                until(lambda: scheduler.get(bindings).json(), lambda found: found == [])
        assert node.cleanup() == []
