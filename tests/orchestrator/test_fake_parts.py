"""The orchestrator over fake parts: its decisions without QEMU, in milliseconds.

The engine is `SandboxBackend` in memory (a VM is a future that resolves when its "process"
exits), the repository, pending snapshots, warm pool and durable pauses are as small as the
orchestrator's use of them, and the store and event bus are the real ones. What is tested is
the orchestrator's own logic: TTLs, restart recovery, pause and resume, take-over and the
events each step publishes. The same paths on real VMs: tests/e2e/test_ttl.py,
tests/e2e/test_restart.py, tests/vm/test_s3_two_nodes.py.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from aenv import clock
from aenv.config import Settings
from aenv.events import Event, EventBus, PauseDurable, SandboxChanged, SandboxLost, SandboxStopped
from aenv.orchestrator.errors import NotFound, Overloaded
from aenv.orchestrator.handover import SANDBOX_RECORD
from aenv.orchestrator.interface import CreateRequest
from aenv.orchestrator.local import LocalNode
from aenv.orchestrator.service import Orchestrator
from aenv.orchestrator.states import State
from aenv.orchestrator.store import SandboxStore
from aenv.repository.errors import SnapshotNotFound
from aenv.snapshot.model import GuestInit, SandboxState
from aenv.vmm.envd_link import SampleBatch

from .conftest import record

TEMPLATE = SimpleNamespace(
    id="tmpl1", alias="base", kind="template", metadata={}, machine=SimpleNamespace(vcpus=1, memory_mib=512)
)


class FakeVM:
    """A running sandbox's VM: its process exits when the engine ends it or the test kills it."""

    _pids = iter(range(1000, 10**6))

    def __init__(self, state: SandboxState, token: str | None):
        self.state = state
        self.pid = next(self._pids)
        self.exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.guest = SimpleNamespace(vm=self, envd=SimpleNamespace(access_token=token), network=None)
        self.envd = SimpleNamespace(metrics_history=self._no_samples)

    @property
    def sandbox_id(self) -> str:
        return self.state.sandbox_id

    @property
    def vm(self) -> FakeVM:
        return self

    async def wait(self) -> int:
        return await asyncio.shield(self.exited)

    def exit(self, code: int) -> None:
        if not self.exited.done():
            self.exited.set_result(code)

    async def _no_samples(self, start: int | None) -> SampleBatch:
        return SampleBatch([], None)


class FakeHandover:
    """Durable pauses: `taken` says which node took a sandbox over; `pauses` are committed ones."""

    enabled = True

    def __init__(self) -> None:
        self.taken: dict[str, str] = {}
        self.pauses: dict[str, Any] = {}

    def moved(self, state: SandboxState) -> str | None:
        return self.taken.get(state.sandbox_id)

    def recover(self, state: SandboxState) -> None:
        pass

    def find(self, sandbox_id: str) -> Any:
        if sandbox_id not in self.pauses:
            raise SnapshotNotFound(sandbox_id)
        return self.pauses[sandbox_id]

    async def close(self) -> None:
        pass


class FakeEngine:
    """`SandboxBackend` in memory, with the parts the orchestrator is given at construction."""

    def __init__(self, home: Path, events: Any):
        self.home = home
        self.events = events
        self.networks = None
        self.states: dict[str, SandboxState] = {}
        self.handover = FakeHandover()
        self.repository = SimpleNamespace(get=self._template, list=lambda kind=None: [TEMPLATE])
        self.pending = SimpleNamespace(
            get=lambda name: None, failure=lambda name: None, elsewhere=self._none, list=list
        )
        self.templates = self.layers = None  # template builds: not run here
        self.pool = SimpleNamespace(ready=lambda snapshot_id: 0, target=lambda snapshot_id: 0)
        self.runtime = SimpleNamespace(cache_stats=lambda: None)
        self.checkpoints = SimpleNamespace(list=lambda sandbox_id: [])
        self.standbys = SimpleNamespace(memory_mib=lambda: 0)
        self.parked = SimpleNamespace(pids=set)
        self.adopted: list[str] = []

    @staticmethod
    def _template(name: str) -> Any:
        if name not in (TEMPLATE.id, TEMPLATE.alias):
            raise SnapshotNotFound(name)
        return TEMPLATE

    @staticmethod
    async def _none(*args: Any) -> None:
        return None

    def workdir(self, sandbox_id: str) -> Path:
        return self.home / sandbox_id

    def load_state(self, sandbox_id: str) -> SandboxState:
        if sandbox_id not in self.states:
            raise FileNotFoundError(sandbox_id)
        return self.states[sandbox_id]

    def _run(self, sandbox_id: str, snapshot: str, init: GuestInit) -> FakeVM:
        state = self.states.setdefault(sandbox_id, SandboxState(sandbox_id, snapshot, ["top"], "net"))
        state.paused = False
        return FakeVM(state, init.access_token)

    async def start(self, snapshot: str, sandbox_id: str, init: GuestInit, policy: Any = None) -> FakeVM:
        return self._run(sandbox_id, snapshot, init)

    async def fork(self, sandbox: FakeVM, children: list[tuple[str, GuestInit]]) -> list[FakeVM]:
        return [self._run(child, "fork1", init) for child, init in children]

    async def take_over(self, pause: Any, init: GuestInit, policy: Any) -> FakeVM:
        return self._run(pause.sandbox_id, pause.id, init)

    async def pause(self, sandbox: FakeVM, *, memory: bool = True) -> SandboxState:
        sandbox.state.paused, sandbox.state.disk_only = True, not memory
        sandbox.exit(0)
        return sandbox.state

    async def resume(self, state: SandboxState, init: GuestInit) -> FakeVM:
        return self._run(state.sandbox_id, state.snapshot_id, init)

    async def kill(self, sandbox: FakeVM | SandboxState) -> None:
        if isinstance(sandbox, FakeVM):
            sandbox.exit(-9)
        self.states.pop(sandbox.sandbox_id, None)

    async def adopt(self, state: SandboxState, access_token: str | None, network: Any = None) -> FakeVM:
        self.adopted.append(state.sandbox_id)
        return FakeVM(state, access_token)

    async def settle_paused(self, state: SandboxState) -> None:
        pass

    def kill_unclaimed_vms(self, claimed: set[int]) -> list[int]:
        return []

    async def close(self) -> None:
        pass


class Node:
    """An orchestrator over the fakes, and every event it published."""

    def __init__(self, home: Path, **settings: Any):
        self.events = EventBus()
        self.published: list[Event] = []
        for kind in (SandboxChanged, SandboxStopped, SandboxLost):
            self.events.subscribe(kind, self.published.append)
        self.engine = FakeEngine(home / "sandboxes", self.events)
        self.store = SandboxStore(home / "node.db")
        values = dict(home_path=home, disk_reserve_mib=0, memory_overcommit=1000.0, evict_interval=3600.0)
        self.settings = Settings(**{**values, **settings})
        self.orchestrator = Orchestrator(self.settings, self.engine, self.store)  # type: ignore[arg-type]

    def of(self, kind: type[Event], sandbox_id: str) -> int:
        return sum(isinstance(e, kind) and e.sandbox_id == sandbox_id for e in self.published)  # type: ignore[attr-defined]


def run(body: Any) -> None:
    asyncio.run(asyncio.wait_for(body(), 10))


def later(monkeypatch: pytest.MonkeyPatch, seconds: int) -> None:
    moment = clock.now() + timedelta(seconds=seconds)
    monkeypatch.setattr(clock, "now", lambda: moment)


def test_a_sandbox_past_its_end_is_paused_with_auto_pause_else_killed(tmp_path: Path, monkeypatch) -> None:
    async def main() -> None:
        node = Node(tmp_path)
        orchestrator = node.orchestrator
        kept = await orchestrator.create(CreateRequest(template="base", timeout=10, auto_pause=True))
        gone = await orchestrator.create(CreateRequest(template="base", timeout=10))
        longer = await orchestrator.create(CreateRequest(template="base", timeout=60))
        await orchestrator.evict_expired()
        assert {s.record.state for s in (kept, gone, longer)} == {State.RUNNING}
        later(monkeypatch, 30)
        await orchestrator.evict_expired()
        assert kept.record.state == State.PAUSED and kept.vm is None and node.of(SandboxStopped, kept.id)
        with pytest.raises(NotFound):
            orchestrator.get(gone.id)
        assert longer.record.state == State.RUNNING
        assert [r.sandbox_id for r in node.store.all() if r.state == State.PAUSED] == [kept.id]

    run(main)


def test_pause_then_connect_resumes_and_a_running_connect_only_extends(tmp_path: Path) -> None:
    async def main() -> None:
        node = Node(tmp_path)
        orchestrator = node.orchestrator
        sandbox = await orchestrator.create(CreateRequest(template="base", timeout=60))
        first_vm = sandbox.vm
        assert sandbox.record.envd_token and first_vm.guest.envd.access_token == sandbox.record.envd_token
        await orchestrator.pause(sandbox)
        assert sandbox.record.state == State.PAUSED and sandbox.record.paused_at
        assert first_vm.exited.done()  # the watcher saw the exit the node asked for: not lost
        await asyncio.sleep(0)
        assert orchestrator.get(sandbox.id) is sandbox and not node.of(SandboxLost, sandbox.id)
        assert await orchestrator.connect(sandbox, 60) is True
        assert sandbox.record.state == State.RUNNING and sandbox.vm is not first_vm
        assert sandbox.record.paused_at is None
        assert await orchestrator.connect(sandbox, 60) is False  # running: its end moves, no resume

    run(main)


def test_a_vm_that_dies_under_the_node_loses_its_sandbox_with_the_reason(tmp_path: Path) -> None:
    async def main() -> None:
        node = Node(tmp_path)
        sandbox = await node.orchestrator.create(CreateRequest(template="base"))
        sandbox.vm.exit(-9)
        for _ in range(100):
            if node.of(SandboxLost, sandbox.id):
                break
            await asyncio.sleep(0)
        with pytest.raises(NotFound, match=r"was lost: .*killed by signal 9"):
            node.orchestrator.get(sandbox.id)
        assert node.orchestrator.counters["lost"] == 1 and node.store.all() == []

    run(main)


def test_restart_recovery_adopts_keeps_and_forgets_what_it_must(tmp_path: Path) -> None:
    """Running with a live VM: adopted and paused. Paused: kept. Durably paused and taken over by
    another node meanwhile: forgotten, saying where it went. Running without saved state: gone."""

    async def main() -> None:
        node = Node(tmp_path)
        ids = {name: f"i{name:a>20}" for name in ("adopt", "kept", "moved", "nostate")}
        for name, state in (("adopt", State.RUNNING), ("kept", State.PAUSED), ("moved", State.PAUSED)):
            node.store.put(record(state, sandbox_id=ids[name], durable=name == "moved"))
            node.engine.states[ids[name]] = SandboxState(
                ids[name], "tmpl1", ["top"], "net", paused=state == State.PAUSED, pid=1, durable="p1"
            )
        node.store.put(record(State.RUNNING, sandbox_id=ids["nostate"]))
        node.engine.handover.taken[ids["moved"]] = "n2"
        await node.orchestrator.start()
        try:
            assert node.engine.adopted == [ids["adopt"]]
            assert node.orchestrator.get(ids["adopt"]).record.state == State.PAUSED
            assert node.orchestrator.get(ids["kept"]).record.state == State.PAUSED
            with pytest.raises(NotFound, match="taken over by node n2"):
                node.orchestrator.get(ids["moved"])
            with pytest.raises(NotFound, match="doesn't exist"):
                node.orchestrator.get(ids["nostate"])
            assert sorted(r.sandbox_id for r in node.store.all()) == sorted([ids["adopt"], ids["kept"]])
        finally:
            await node.orchestrator.close()

    run(main)


def test_a_durable_pause_is_reported_taken_over_elsewhere_and_taken_over_here(tmp_path: Path) -> None:
    async def main() -> None:
        node = Node(tmp_path)
        orchestrator = node.orchestrator
        sandbox = await orchestrator.create(CreateRequest(template="base", metadata={"k": "v"}))
        await orchestrator.pause(sandbox)
        generation = sandbox.record.generation
        node.events.publish(PauseDurable(sandbox.id))
        assert sandbox.record.durable and sandbox.record.generation == generation + 1
        stored = {r.sandbox_id: r for r in node.store.all()}[sandbox.id]
        assert stored.durable  # what the scheduler is told, and what a restart reads

        node.engine.handover.taken[sandbox.id] = "n2"
        await orchestrator.forget_moved()
        with pytest.raises(NotFound, match="taken over by node n2"):
            orchestrator.get(sandbox.id)

        # Node n2's side: the pause carries the record; the sandbox continues under its id.
        other = Node(tmp_path / "n2")
        pause = SimpleNamespace(
            id="pause1", sandbox_id=sandbox.id, metadata={SANDBOX_RECORD: json.dumps(asdict(sandbox.record))}
        )
        other.engine.handover.pauses[sandbox.id] = pause
        taken = await other.orchestrator.take_over(sandbox.id, 60)
        assert taken.id == sandbox.id and taken.record.state == State.RUNNING
        assert taken.record.metadata == {"k": "v"} and taken.record.envd_token == sandbox.record.envd_token
        assert not taken.record.durable
        with pytest.raises(NotFound, match="no durable pause"):
            await other.orchestrator.take_over("i" + "z" * 20, None)

    run(main)


def test_fork_children_are_new_sandboxes_with_their_own_tokens(tmp_path: Path) -> None:
    async def main() -> None:
        node = Node(tmp_path)
        orchestrator = node.orchestrator
        source = await orchestrator.create(CreateRequest(template="base", env_vars={"A": "1"}))
        children = await orchestrator.fork(source, 2, 30)
        assert len({c.id for c in children} | {source.id}) == 3
        for child in children:
            assert child.record.state == State.RUNNING and child.record.env_vars == {"A": "1"}
            assert child.record.envd_token not in (None, source.record.envd_token)
            assert child.record.timeout == 30 and child.record.generation == 1
        assert source.record.state == State.RUNNING

    run(main)


def test_the_node_service_lists_and_finds_through_the_catalog(tmp_path: Path) -> None:
    async def main() -> None:
        node = Node(tmp_path)
        service = LocalNode(node.orchestrator, None, "n1")  # type: ignore[arg-type]
        assert [m.id for m in await service.catalog()] == ["tmpl1"]
        assert (await service.find("team/base:latest")).id == "tmpl1"
        with pytest.raises(NotFound, match="'nothing' not found"):
            await service.find("nothing")

    run(main)


def test_a_create_the_start_gate_refuses_reads_no_template(tmp_path: Path) -> None:
    """A node that is starting all it can answers 429 before the template's files are read: such
    creates come back every moment from a busy harness (256 rollouts at once)."""

    async def main() -> None:
        node = Node(tmp_path)
        looked_up: list[str] = []
        node.engine.repository.get = lambda name: looked_up.append(name) or TEMPLATE
        gate = node.orchestrator.lifecycle.starts
        gate.waiting, gate.estimate = 10 * gate.concurrency, 60.0  # minutes of starts ahead
        with pytest.raises(Overloaded):
            await node.orchestrator.create(CreateRequest(template="base", timeout=60))
        assert looked_up == []
        gate.waiting = 0
        await node.orchestrator.create(CreateRequest(template="base", timeout=60))
        assert looked_up == ["base"]

    run(main)
