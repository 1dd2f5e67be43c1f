"""`aenv scheduler` as a process (its settings, its port, SIGTERM) and `aenv node ls|drain`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.cli import main
from aenv.cluster.client import SchedulerClient

from .processes import scheduler_process
from .test_placement import node

SECRET = "cli-secret"


@pytest.fixture
def scheduler_url(redis_url: str, tmp_path: Path) -> Iterator[str]:
    with scheduler_process(redis_url, tmp_path / "scheduler.log", SECRET) as url:
        yield url


def test_node_ls_and_drain(
    scheduler_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    async def join() -> None:
        client = SchedulerClient(scheduler_url, SECRET)
        await client.register(node("n1"))
        await client.close()

    asyncio.run(join())
    monkeypatch.setenv("AENV_CLUSTER_SECRET", SECRET)
    monkeypatch.delenv("AENV_SCHEDULER_URL", raising=False)
    assert main(["node", "--scheduler-url", scheduler_url, "ls", "-o", "json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert (listed["node_id"], listed["status"]) == ("n1", "up")
    monkeypatch.setenv("AENV_SCHEDULER_URL", scheduler_url)
    assert main(["node", "drain", "n1", "-o", "table"]) == 0
    assert "Draining node n1" in capsys.readouterr().out
    assert main(["node", "ls", "-o", "table"]) == 0
    assert "draining" in capsys.readouterr().out
    assert main(["node", "drain", "nope", "--scheduler-url", scheduler_url]) == 1
    assert "node nope is not registered" in capsys.readouterr().err
    monkeypatch.setenv("AENV_CLUSTER_SECRET", "wrong")
    assert main(["node", "ls"]) == 1
    assert "cluster secret" in capsys.readouterr().err
