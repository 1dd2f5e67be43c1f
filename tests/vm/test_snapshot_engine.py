"""The snapshot engine on real VMs: pause/resume, snapshots, forks and their guarantees."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import secrets
import subprocess
import threading
import time
from pathlib import Path

import pytest
from e2b import AuthenticationException

from aenv.agent.envd.system_api import CLOCK_TOLERANCE_NS
from aenv.repository.errors import SnapshotNotFound
from aenv.repository.manifest import new_snapshot_id
from aenv.repository.posix import SnapshotRepository
from aenv.snapshot.engine import EngineError, GuestInit, SnapshotEngine
from aenv.snapshot.handover import pause_alias
from aenv.snapshot.parking import ParkingPolicy
from aenv.snapshot.warm import WarmRecord

from ..conftest import RunningSandbox, wait_for

# A long-running interpreter that keeps a value in memory and serves it with its PID.
KEEPER = """
import http.server, os, sys
state = {"mark": sys.argv[1]}
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"{os.getpid()} {state['mark']}".encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def do_PUT(self):
        state["mark"] = self.rfile.read(int(self.headers["Content-Length"])).decode()
        self.send_response(204); self.end_headers()
    def log_message(self, *args): pass
http.server.HTTPServer(("127.0.0.1", 8123), Handler).serve_forever()
"""
ASK_KEEPER = "for i in $(seq 100); do curl -sf localhost:8123 && exit 0; sleep 0.1; done; exit 1"


def start_keeper(sdk, mark: str) -> int:
    sdk.files.write("/tmp/keeper.py", KEEPER)
    sdk.commands.run(f"python3 /tmp/keeper.py {mark}", background=True, timeout=0)
    pid, seen = sdk.commands.run(ASK_KEEPER).stdout.split()
    assert seen == mark
    return int(pid)


def ask_keeper(sdk) -> tuple[int, str]:
    pid, mark = sdk.commands.run(ASK_KEEPER).stdout.split()
    return int(pid), mark


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def assert_clock_set(sdk) -> None:
    """The guest's clock is the host's, within envd's tolerance (`CLOCK_TOLERANCE_NS`)."""
    before = time.time_ns()
    guest_ns = int(sdk.commands.run("date +%s%N").stdout)
    assert before - CLOCK_TOLERANCE_NS <= guest_ns <= time.time_ns() + CLOCK_TOLERANCE_NS


def test_pause_resume_continues_exactly(base_template, sandboxes):
    sandbox = sandboxes.start(base_template.id)
    sdk = sandbox.sdk()
    mark = secrets.token_hex(8)
    keeper_pid = start_keeper(sdk, mark)
    counter = sdk.commands.run(
        "i=0; while :; do i=$((i+1)); echo $i; echo $i > /tmp/counter; sleep 0.1; done",
        background=True,
        timeout=0,
    )
    sdk.files.write("/home/user/note.txt", mark)
    time.sleep(1)
    before = int(sdk.files.read("/tmp/counter"))

    sandboxes.pause(sandbox)
    sdk = sandboxes.resume(sandbox.sandbox_id).sdk()

    assert ask_keeper(sdk) == (keeper_pid, mark)
    assert sdk.files.read("/home/user/note.txt") == mark
    assert counter.pid in [p.pid for p in sdk.commands.list()]
    handle = sdk.commands.connect(counter.pid)
    stdout = next(iter(handle))[0]
    handle.disconnect()
    assert int(stdout.split()[0]) > before
    # A second cycle stacks on the first.
    sdk.commands.run("curl -sf -X PUT --data second localhost:8123")
    sandboxes.pause(sandboxes._running[sandbox.sandbox_id])
    sdk = sandboxes.resume(sandbox.sandbox_id).sdk()
    assert ask_keeper(sdk) == (keeper_pid, "second")


def test_snapshot_after_large_write_restores_the_data(base_template, sandboxes):
    source = sandboxes.start(base_template.id)
    sdk = sandbox_sdk = source.sdk()
    mark = secrets.token_hex(8)
    assert sdk.commands.run(f"yes {mark} | head -c 1G > /home/user/big && sync", timeout=600).exit_code == 0
    tail = sdk.commands.run("tail -c 64 /home/user/big").stdout

    snapshot = sandboxes.snapshot(source, metadata={"purpose": "test"})
    assert snapshot.kind == "snapshot" and snapshot.metadata == {"purpose": "test"}

    # The source keeps running and keeps writing to its own layer.
    sandbox_sdk.files.write("/home/user/after.txt", "source only")
    child = sandboxes.start(snapshot.id).sdk()
    assert child.commands.run("stat -c %s /home/user/big").stdout.strip() == str(1 << 30)
    assert child.commands.run("tail -c 64 /home/user/big").stdout == tail
    assert not child.files.exists("/home/user/after.txt")


def test_fork_children_inherit_then_diverge(base_template, sandboxes):
    parent = sandboxes.start(base_template.id)
    sdk = parent.sdk()
    mark = secrets.token_hex(8)
    start_keeper(sdk, mark)
    sdk.files.write("/home/user/marker", mark)

    children = sandboxes.fork(parent, 16)
    assert len({c.sandbox_id for c in children}) == 16
    for child in children:
        child_sdk = child.sdk()
        assert ask_keeper(child_sdk)[1] == mark
        assert child_sdk.files.read("/home/user/marker") == mark
        child_sdk.files.write("/home/user/marker", child.sandbox_id)
        child_sdk.commands.run(f"curl -sf -X PUT --data {child.sandbox_id} localhost:8123")
    for child in children:
        child_sdk = child.sdk()
        assert child_sdk.files.read("/home/user/marker") == child.sandbox_id
        assert ask_keeper(child_sdk)[1] == child.sandbox_id
        assert_clock_set(child_sdk)  # set again once each had answered its first /init
    assert sdk.files.read("/home/user/marker") == mark
    assert ask_keeper(sdk)[1] == mark


def test_memory_image_never_changes(base_template, engine, sandboxes):
    image = engine.runtime.memory_image(base_template)
    before = sha256(image)
    sandbox = sandboxes.start(base_template.id)
    sdk = sandbox.sdk()
    vm = sandbox.vm.vm
    assert "THP_enabled:\t0" in Path(f"/proc/{vm.pid}/status").read_text()  # no 2 MiB pages for QEMU
    sdk.commands.run("python3 -c 'b = bytearray(64 << 20); b[::4096] = b\"x\" * len(b[::4096])'")
    sandboxes.node.run(vm.command("balloon", value=256 << 20))
    time.sleep(3)
    sandboxes.node.run(vm.command("balloon", value=512 << 20))
    sdk.commands.run("sync; echo 3 > /proc/sys/vm/drop_caches", user="root")
    sandboxes.pause(sandbox)
    sandboxes.resume(sandbox.sandbox_id).sdk().commands.run("true")
    sandboxes.kill(sandbox.sandbox_id)
    assert sha256(image) == before


def test_deleting_a_snapshot_in_use_is_deferred(base_template, engine, sandboxes):
    source = sandboxes.start(base_template.id)
    source.sdk().files.write("/home/user/from-source", "yes")
    snapshot = sandboxes.snapshot(source)
    child = sandboxes.start(snapshot.id)

    assert engine.repository.delete(snapshot.id) is False
    assert snapshot.id not in [m.id for m in engine.repository.list()]
    # The child keeps working, through a pause and resume too.
    sandboxes.pause(child)
    child_sdk = sandboxes.resume(child.sandbox_id).sdk()
    assert child_sdk.files.read("/home/user/from-source") == "yes"

    sandboxes.kill(child.sandbox_id)
    assert not engine.repository.is_live(snapshot.id)
    with pytest.raises(Exception, match="not found"):
        engine.repository.get(snapshot.id)


@contextlib.contextmanager
def full_disk(directory: Path):
    """Mount a tiny tmpfs over `directory` so that writing there fails with ENOSPC."""
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(directory)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)


def test_disk_full_during_pause_or_snapshot_leaves_the_sandbox_running(base_template, engine, sandboxes):
    sandbox = sandboxes.start(base_template.id)
    sdk = sandbox.sdk()
    sdk.files.write("/home/user/keep", "intact")
    sdk.commands.run("python3 -c 'b = bytearray(32 << 20); b[::4096] = b\"y\" * len(b[::4096])'")

    with full_disk(engine.workdir(sandbox.sandbox_id)), pytest.raises(OSError):
        sandboxes.node.run(engine.pause(sandbox.vm))
    assert sdk.files.read("/home/user/keep") == "intact"

    with full_disk(engine.pending.root), pytest.raises(OSError):
        sandboxes.node.run(engine.snapshot(sandbox.vm))
    assert sdk.files.read("/home/user/keep") == "intact"
    assert sandbox.vm.state.disk_layers == engine.load_state(sandbox.sandbox_id).disk_layers

    sandboxes.pause(sandbox)
    assert sandboxes.resume(sandbox.sandbox_id).sdk().files.read("/home/user/keep") == "intact"


def test_paused_sandbox_survives_a_new_engine(base_template, engine, node_home, guest_artifacts, sandboxes):
    sandbox = sandboxes.start(base_template.id)
    mark = secrets.token_hex(8)
    keeper_pid = start_keeper(sandbox.sdk(), mark)
    sandboxes.pause(sandbox)
    sandboxes._paused.pop(sandbox.sandbox_id)

    restarted = SnapshotEngine(
        node_home, SnapshotRepository(node_home / "repository"), guest_artifacts, engine.accel
    )
    state = restarted.load_state(sandbox.sandbox_id)
    assert state.paused
    token = secrets.token_hex(8)
    vm = sandboxes.node.run(restarted.resume(state, GuestInit(access_token=token)))
    try:
        exposed = sandboxes.node.run(sandboxes._expose(vm))
        assert ask_keeper(exposed.sdk()) == (keeper_pid, mark)
    finally:
        sandboxes._unexpose(sandbox.sandbox_id)
        sandboxes.node.run(restarted.kill(vm))


def test_restoring_on_a_different_machine_is_refused(
    base_template, engine, node_home, guest_artifacts, sandboxes
):
    machine = dataclasses.replace(base_template.machine, qemu_version="9.9.9")
    foreign = dataclasses.replace(base_template, id=new_snapshot_id(), alias=None, machine=machine)
    engine.repository.commit(foreign)
    with pytest.raises(
        EngineError, match=r"taken with qemu_version=9\.9\.9 but this node runs qemu_version="
    ):
        sandboxes.start(foreign.id)
    legacy = dataclasses.replace(base_template.machine, machine_type="microvm")  # with PIT, PIC and RTC
    problem = sandboxes.node.run(engine.incompatibility(dataclasses.replace(foreign, machine=legacy)))
    assert problem is not None and "machine_type=microvm but this node runs machine_type=microvm," in problem
    assert sandboxes.node.run(engine.incompatibility(base_template)) is None
    assert engine.repository.holders(foreign.id) == []
    engine.repository.delete(foreign.id)

    other_accel = "kvm" if engine.accel == "tcg" else "tcg"
    elsewhere = SnapshotEngine(node_home, engine.repository, guest_artifacts, other_accel)
    with pytest.raises(EngineError, match=f"accel={engine.accel} but this node runs accel={other_accel}"):
        sandboxes.node.run(elsewhere.start(base_template.id, "tmismatch", GuestInit()))
    assert "tmismatch" not in engine.repository.holders(base_template.id)


def test_garbage_is_collected(base_template, engine, sandboxes):
    source = sandboxes.start(base_template.id)
    running = sandboxes.start(base_template.id)
    snapshot = sandboxes.snapshot(source)
    sealed = [layer for layer in snapshot.disk_layers if layer not in base_template.disk_layers]
    sandboxes.kill(source.sandbox_id)
    engine.repository.delete(snapshot.id)
    sandboxes.node.run(engine.pool.set_target(base_template.id, 1))
    try:
        sandboxes.node.run(engine.pool.wait_filled(base_template.id))
        records = [WarmRecord.load(r) for r in WarmRecord.found(engine.warm.directory)]
        assert all(r.ready for r in records)  # in the pool: its record says so (the bench waits for it)
        warm = [r.top_layer for r in records]
        report = engine.collect_garbage(grace_seconds=0)
        # What a running sandbox or a warm VM writes to is never garbage, however old.
        kept = [*warm, running.vm.state.disk_layers[-1]]
        assert warm and all(engine.layers.exists(layer) for layer in kept)
    finally:
        sandboxes.node.run(engine.pool.drain(base_template.id))
    assert set(sealed) <= set(report.removed_layers)
    assert snapshot.device_state in report.blobs.removed_blobs or not engine.repository.has_blob(
        snapshot.device_state
    )
    for layer in base_template.disk_layers:
        assert engine.layers.exists(layer)
    assert engine.repository.has_blob(base_template.memory_image)


def test_warm_pool_hands_out_restored_guests(base_template, engine, sandboxes):
    """A secured create without variables takes a warm VM as it is (its own token, a clock set in
    the pool); one with variables, or an unsecured one, gives it an `/init` first."""
    node, pool = sandboxes.node, engine.pool
    node.run(pool.set_target(base_template.id, 2))

    def from_pool(init: GuestInit | None = None) -> RunningSandbox:
        node.run(pool.wait_filled(base_template.id))
        sandbox = sandboxes.start(base_template.id, init)
        assert sandbox.vm.state.network_name.startswith("aenv-w")  # a warm VM's, not its own
        return sandbox

    try:
        first, second = from_pool(), from_pool()
        for sandbox in (first, second):
            sdk = sandbox.sdk()
            # What each did in the pool (`rehearse`) left no process and no file.
            assert sdk.commands.list() == []
            assert ".aenv-rehearsal" not in sdk.commands.run("ls -a /tmp").stdout
            assert_clock_set(sdk)
            sdk.files.write("/home/user/who", sandbox.sandbox_id)
        assert first.sdk().files.read("/home/user/who") == first.sandbox_id
        # Each got its own token: the other's is refused.
        assert first.access_token and second.access_token and first.access_token != second.access_token
        stranger = RunningSandbox(vm=first.vm, envd_url=first.envd_url, access_token=second.access_token)
        with pytest.raises(AuthenticationException):
            stranger.sdk().commands.run("true")
        holders = engine.repository.holders(base_template.id)
        assert first.sandbox_id in holders and second.sandbox_id in holders
        named = from_pool(GuestInit(env_vars={"WHO": "named"}, access_token="the-token"))
        assert named.access_token == "the-token"
        assert named.sdk().commands.run("echo $WHO").stdout == "named\n"
        unsecured = from_pool(GuestInit())
        assert unsecured.access_token is None
        assert unsecured.sdk().commands.run("true").exit_code == 0
    finally:
        node.run(pool.drain(base_template.id))
    assert pool.ready(base_template.id) == 0
    assert not [h for h in engine.repository.holders(base_template.id) if h.startswith("w")]


@pytest.mark.parametrize("parked", [False, True], ids=["from-disk", "parked"])
def test_a_local_resume_supersedes_the_running_pause_upload(
    base_template, engine, node_loop, sandboxes, monkeypatch, parked: bool
):
    """With durable pauses on, a resume here does not wait for the pause's upload: the upload never
    commits (no pause snapshot another node could take over), the sandbox continues on a new layer
    over the one the upload reads (its kept QEMU process, if parked, switches to it), and its next
    pause becomes durable as usual."""
    monkeypatch.setattr(engine.handover, "enabled", True)
    if parked:
        monkeypatch.setattr(engine.parked, "policy", ParkingPolicy(max_seconds=60, max_count=8))
    entered, gate, left = threading.Event(), threading.Event(), threading.Event()
    put_blob = engine.repository.put_blob

    def held(*args, **kwargs):  # the upload's first store waits until the test lets it go
        entered.set()
        gate.wait(300)
        left.set()
        return put_blob(*args, **kwargs)

    monkeypatch.setattr(engine.repository, "put_blob", held)
    sandbox = sandboxes.start(base_template.id)
    sandbox.sdk().files.write("/tmp/state", "paused once")
    chain = list(sandboxes.pause(sandbox).disk_layers)
    try:
        assert entered.wait(120)  # parked: once the pages are saved, after the pause returned
        resumed = sandboxes.resume(sandbox.sandbox_id)
        assert not left.is_set()  # resumed while the upload still held its first store
    finally:
        gate.set()
        node_loop.run(engine.parked.release_all())
    assert (resumed.vm.vm.pid == sandbox.vm.vm.pid) is parked
    node_loop.run(engine.handover.close())  # the superseded upload ends without committing
    alias = pause_alias(sandbox.sandbox_id)
    with pytest.raises(SnapshotNotFound):
        engine.repository.get(alias)
    state = resumed.vm.state
    assert state.disk_layers[:-1] == chain and state.durable is None
    assert engine.layers.path(chain[-1]).stat().st_mode & 0o222 == 0  # sealed: the upload's copy holds
    sdk = resumed.sdk()
    assert sdk.files.read("/tmp/state") == "paused once"
    sdk.files.write("/tmp/state", "paused twice")
    paused = sandboxes.pause(resumed)
    wait_for(lambda: paused.durable is not None, timeout=120)  # no resume meanwhile: committed
    assert paused.durable == engine.repository.get(alias).id
    assert sandboxes.resume(sandbox.sandbox_id).sdk().files.read("/tmp/state") == "paused twice"
    with pytest.raises(SnapshotNotFound):  # claimed by the resume here, and retired
        engine.repository.get(alias)
