"""The confined volume server without a VM: `aenv.volumes.jail` started as the node starts it,
in a network namespace of the test's own, attacked over raw 9P from that namespace (the same
client the hostile-guest test runs in a real guest: tests/e2e/test_hostile_volumes.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

from aenv.volumes import jail
from aenv.volumes.server import DIOD, export_path
from aenv.volumes.store import GUEST_IDS, IdRange, VolumeStore
from aenv.volumes.tree import remove_tree

ATTACK = Path(__file__).parents[1] / "e2e" / "ninep_attack.py"
ADDRESS = "10.254.254.1"
PORT = 564
IDS = IdRange(1_900_000_000, GUEST_IDS)


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"aenvt-jail-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "-n", name, "addr", "add", f"{ADDRESS}/32", "dev", "lo"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=True)


@pytest.fixture
def server(netns: str, tmp_path: Path) -> Iterator[tuple[str, Path, int]]:
    store = VolumeStore(tmp_path / "volumes", IDS, 16)
    volume = store.create("jailed")
    (tmp_path / "root").mkdir()
    spec = jail.Spec(
        root=str(tmp_path / "root"), exports={export_path("jailed"): str(store.data(volume))},
        files=jail.server_files(DIOD), listen=f"{ADDRESS}:{PORT}", uid_base=IDS.base,
        uid_count=IDS.count, cgroup=f"test-{netns}",
    )  # fmt: skip
    argv = [
        "nsenter",
        f"--net=/run/netns/{netns}",
        sys.executable,
        "-m",
        jail.__name__,
        json.dumps(asdict(spec)),
    ]
    process = subprocess.Popen(argv, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while f":{PORT}".encode() not in subprocess.run(["ip", "netns", "exec", netns, "ss", "-ltnH"],
                                                        capture_output=True, check=True).stdout:  # fmt: skip
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.02)
        yield netns, store.data(volume), process.pid
    finally:
        process.kill()
        process.wait()
        for group in jail.cgroup_dirs(spec.cgroup).values():
            group.rmdir()
        store.close()


def test_a_client_claiming_root_reaches_no_device_and_only_its_range(server: tuple[str, Path, int]) -> None:
    netns, data, pid = server
    client = [sys.executable, str(ATTACK), ADDRESS, str(PORT), export_path("jailed")]
    said = subprocess.run(["ip", "netns", "exec", netns, *client], capture_output=True, text=True, check=True)
    results = json.loads(said.stdout)
    assert results["mknod"] == {"errno": 1} and "lopen" not in results, results
    assert results["owner"] == {"ok": [0, 0]}  # the guests' root, within the volume
    status = Path(f"/proc/{pid}/status").read_text()
    assert f"Uid:\t{IDS.base}\t{IDS.base}\t{IDS.base}\t{IDS.base}" in status
    assert "NoNewPrivs:\t1" in status and "Seccomp:\t2" in status
    points = [line.split()[4] for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()]
    assert "/usr" not in points and "/proc" not in points and "/v/jailed" in points
    assert list(data.iterdir()) == []


def test_trees_go_whatever_their_depth_and_links(tmp_path: Path) -> None:
    """1,500 levels (a path longer than PATH_MAX), symlinks to outside left alone."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("kept")
    top = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = os.dup(top)
        for depth in range(1500):
            os.mkdir("d", dir_fd=fd)
            if depth == 1:
                os.symlink(outside, "link", dir_fd=fd)
                os.symlink(outside / "keep", "file-link", dir_fd=fd)
            below = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = below
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
        os.close(fd)
        remove_tree(top, "d")
        remove_tree(top, "missing")  # nothing to do
    finally:
        os.close(top)
    assert not (tmp_path / "d").exists() and (outside / "keep").read_text() == "kept"
