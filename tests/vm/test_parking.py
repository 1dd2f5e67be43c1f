"""Parked pauses on real VMs: the stopped QEMU process is kept for an instant resume.

The pause must be on disk all the same, so that ending the process (by age, by count, on
shutdown or after a node crash) loses nothing.
"""

from __future__ import annotations

import os
import secrets

import pytest

from aenv.repository.posix import SnapshotRepository
from aenv.snapshot.engine import GuestInit, SnapshotEngine
from aenv.snapshot.parking import ParkingPolicy

from ..conftest import wait_for
from .test_snapshot_engine import ask_keeper, start_keeper


def alive(pid: int) -> bool:
    """Running or stopped, not exited (a zombie waits for its parent, here the test process)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def parking(engine, node_loop):
    """Parking switched on for one test; every kept process is ended afterwards."""
    engine.parked.policy = ParkingPolicy(max_seconds=60, max_count=8)
    yield engine.parked
    engine.parked.policy = ParkingPolicy(max_seconds=0)
    node_loop.run(engine.parked.release_all())


def test_parked_sandbox_resumes_in_the_same_process(base_template, engine, parking, sandboxes):
    sandbox = sandboxes.start(base_template.id)
    sdk = sandbox.sdk()
    mark = secrets.token_hex(8)
    keeper_pid = start_keeper(sdk, mark)
    sdk.files.write("/home/user/note.txt", mark)
    qemu_pid = sandbox.vm.vm.pid

    state = sandboxes.pause(sandbox)
    assert state.paused and sandbox.sandbox_id in parking
    assert sandboxes.node.run(sandbox.vm.vm.command("query-status"))["status"] == "paused"
    wait_for(lambda: engine.load_state(sandbox.sandbox_id).delta is not None)  # on disk, in the background

    resumed = sandboxes.resume(sandbox.sandbox_id)
    assert resumed.vm.vm.pid == qemu_pid
    assert sandbox.sandbox_id not in parking
    assert ask_keeper(resumed.sdk()) == (keeper_pid, mark)
    assert resumed.sdk().files.read("/home/user/note.txt") == mark
    assert not engine.load_state(sandbox.sandbox_id).paused


def test_released_process_resumes_from_disk(base_template, engine, parking, sandboxes):
    parking.policy = ParkingPolicy(max_seconds=0.5, max_count=8)
    sandbox = sandboxes.start(base_template.id)
    mark = secrets.token_hex(8)
    keeper_pid = start_keeper(sandbox.sdk(), mark)
    qemu_pid = sandbox.vm.vm.pid

    sandboxes.pause(sandbox)
    wait_for(lambda: not alive(qemu_pid) and engine.load_state(sandbox.sandbox_id).pid is None)
    assert sandbox.sandbox_id not in parking

    resumed = sandboxes.resume(sandbox.sandbox_id)
    assert resumed.vm.vm.pid != qemu_pid
    assert ask_keeper(resumed.sdk()) == (keeper_pid, mark)


def test_a_resume_during_the_capture_stops_it_and_continues_exactly(
    base_template, engine, parking, sandboxes
):
    """Resumed at once, a sandbox does not wait for its pause to reach the disk: the capture of
    its 128 MiB of changed pages stops, its files go (removed in the background), and the guest
    goes on as it was; a later pause is on disk as usual."""
    sandbox = sandboxes.start(base_template.id)
    sdk = sandbox.sdk()
    sdk.commands.run("head -c 128M /dev/urandom > /dev/shm/big && sha256sum /dev/shm/big > /tmp/big.sum")
    expected = sdk.commands.run("cat /tmp/big.sum").stdout
    qemu_pid = sandbox.vm.vm.pid
    sandboxes.pause(sandbox)
    resumed = sandboxes.resume(sandbox.sandbox_id)
    assert resumed.vm.vm.pid == qemu_pid
    workdir = engine.workdir(sandbox.sandbox_id)
    wait_for(lambda: not list(workdir.glob("*.delta")))  # stopped, or flushed and discarded
    assert resumed.sdk().commands.run("sha256sum /dev/shm/big").stdout == expected

    parking.policy = ParkingPolicy(max_seconds=0.5, max_count=8)
    sandboxes.pause(resumed)
    wait_for(lambda: not alive(qemu_pid) and engine.load_state(sandbox.sandbox_id).pid is None, timeout=120)
    assert len(list(workdir.glob("*.delta"))) == 1
    again = sandboxes.resume(sandbox.sandbox_id)
    assert again.sdk().commands.run("sha256sum /dev/shm/big").stdout == expected


def test_count_limit_releases_the_oldest(base_template, engine, parking, sandboxes):
    parking.policy = ParkingPolicy(max_seconds=60, max_count=1)
    first, second = sandboxes.start(base_template.id), sandboxes.start(base_template.id)
    marks = {}
    for sandbox in (first, second):
        marks[sandbox.sandbox_id] = secrets.token_hex(8)
        sandbox.sdk().files.write("/home/user/note.txt", marks[sandbox.sandbox_id])
    first_pid = first.vm.vm.pid
    sandboxes.pause(first)
    sandboxes.pause(second)
    wait_for(lambda: not alive(first_pid))
    assert first.sandbox_id not in parking and second.sandbox_id in parking
    for sandbox in (first, second):
        resumed = sandboxes.resume(sandbox.sandbox_id)
        assert resumed.sdk().files.read("/home/user/note.txt") == marks[sandbox.sandbox_id]


def test_killing_a_parked_sandbox_ends_its_process(base_template, engine, parking, sandboxes):
    sandbox = sandboxes.start(base_template.id)
    qemu_pid, network = sandbox.vm.vm.pid, sandbox.vm.guest.network.name
    sandboxes.pause(sandbox)
    sandboxes.kill(sandbox.sandbox_id)
    assert not alive(qemu_pid)
    assert not os.path.exists(f"/run/netns/{network}")
    assert not engine.workdir(sandbox.sandbox_id).exists()
    assert sandbox.sandbox_id not in parking


def test_restarted_node_saves_a_parked_sandbox_it_finds(
    base_template, engine, parking, node_home, guest_artifacts, sandboxes
):
    """A node that died before writing a parked sandbox's device state and pages: the next one
    captures them from the stopped process."""
    sandbox = sandboxes.start(base_template.id)
    mark = secrets.token_hex(8)
    keeper_pid = start_keeper(sandbox.sdk(), mark)
    qemu_pid = sandbox.vm.vm.pid
    sandboxes.pause(sandbox)
    sandboxes._paused.pop(sandbox.sandbox_id)
    parked = parking.take(sandbox.sandbox_id)  # what the dying node process knew is gone
    assert parked is not None
    restarted = SnapshotEngine(
        node_home, SnapshotRepository(node_home / "repository"), guest_artifacts, engine.accel
    )
    vm = None

    async def captured() -> None:
        await parked.capture

    try:
        sandboxes.node.run(captured())
        state = engine.load_state(sandbox.sandbox_id)
        os.unlink(state.delta)  # as if it had died before the capture
        os.unlink(state.devices)
        state.delta = state.devices = None
        state.save(engine.workdir(sandbox.sandbox_id))

        sandboxes.node.run(restarted.settle_paused(restarted.load_state(sandbox.sandbox_id)))
        wait_for(lambda: not alive(qemu_pid), timeout=10)
        state = restarted.load_state(sandbox.sandbox_id)
        assert state.pid is None and state.delta is not None and state.devices is not None
        parked.sandbox.guest.network.destroy()  # a node's network pool removes it at start
        token = secrets.token_hex(8)
        vm = sandboxes.node.run(restarted.resume(state, GuestInit(access_token=token)))
        exposed = sandboxes.node.run(sandboxes._expose(vm))
        assert ask_keeper(exposed.sdk()) == (keeper_pid, mark)
    finally:
        sandboxes._unexpose(sandbox.sandbox_id)
        sandboxes.node.run(parked.sandbox.guest.destroy(keep_files=True))  # if the test failed early
        sandboxes.node.run(restarted.kill(vm or restarted.load_state(sandbox.sandbox_id)))


def test_failed_resume_of_a_parked_sandbox_leaves_it_paused(base_template, engine, parking, sandboxes):
    sandbox = sandboxes.start(base_template.id)
    mark = secrets.token_hex(8)
    sandbox.sdk().files.write("/home/user/note.txt", mark)
    qemu_pid = sandbox.vm.vm.pid
    sandboxes.pause(sandbox)
    wait_for(lambda: engine.load_state(sandbox.sandbox_id).delta is not None)

    async def refuse(*args, **kwargs):
        raise RuntimeError("envd refused")

    sandbox.vm.envd.init = refuse  # the next /init fails
    state, token = sandboxes._paused[sandbox.sandbox_id]
    with pytest.raises(RuntimeError, match="envd refused"):
        sandboxes.node.run(engine.resume(state, GuestInit(access_token=token)))
    del sandbox.vm.envd.init
    assert not alive(qemu_pid) and sandbox.sandbox_id not in parking
    assert engine.load_state(sandbox.sandbox_id).paused  # the pause on disk is still there

    resumed = sandboxes.resume(sandbox.sandbox_id)
    assert resumed.sdk().files.read("/home/user/note.txt") == mark
