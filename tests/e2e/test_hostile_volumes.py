"""A hostile guest against its volume server and the volume API, from inside a real sandbox
(issue 31, items 1, 4, 5 and 6): raw 9P claiming uid 0 to make and read a host device, `mknod`
through the guest's own mount, a volume filled past its size, a tree 1,200 levels deep.
Each attack is shown refused or bounded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aenv.config import Settings
from aenv.network.netns import GATEWAY_ADDRESS
from aenv.volumes.server import PORT, export_path

from .conftest import NodeServer, Sandboxes, run_in

ATTACK = Path(__file__).with_name("ninep_attack.py")
EPERM = 1
SMALL_MIB = 16


@pytest.fixture
def volumes(node: NodeServer, sandboxes: Sandboxes, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple]:
    """A volume of the node's default size and one of 16 MiB (aenv's `sizeMiB`)."""
    from e2b import Volume

    monkeypatch.setenv("E2B_VOLUME_API_URL", node.url)
    shared = Volume.create(f"hostile-{sandboxes.tag}")
    answer = httpx.post(
        f"{node.url}/volumes",
        json={"name": f"small-{sandboxes.tag}", "sizeMiB": SMALL_MIB},
        headers={"X-API-Key": node.key},
    )
    assert answer.status_code == 201, answer.text
    small = Volume.connect(answer.json()["volumeID"])
    yield shared, small
    sandboxes.close()
    sandboxes.ids.clear()
    for volume in (shared, small):
        Volume.destroy(volume.volume_id)


def servers_of(node: NodeServer) -> list[int]:
    """The pids of the node's volume servers (diod is its child: every launcher execs in place)."""
    children = []
    for task in Path(f"/proc/{node.pid}/task").iterdir():
        children += (task / "children").read_text().split()
    return [int(pid) for pid in children if Path(f"/proc/{pid}/comm").read_text().strip() == "diod"]


def assert_confined(pid: int) -> None:
    """What the server has on the host: a uid of the range, no new privileges, seccomp, a root of
    diod, its libraries and the volumes (nodev, nosuid), and a devices cgroup that denies all."""
    status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    assert status["Uid"].split() == [str(Settings().volume_uid_base)] * 4, status["Uid"]
    assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2"
    assert Path(f"/proc/{pid}/uid_map").read_text().split() == ["0", str(Settings().volume_uid_base), "65536"]
    mounts = {
        line.split()[4]: line.split()[5] for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
    }
    assert "ro" in mounts.pop("/").split(",")
    for point, options in mounts.items():
        assert point == "/diod" or point.startswith(("/lib", "/v/")), point  # no /usr, /proc, /dev
        assert {"nodev", "nosuid"} <= set(options.split(",")), (point, options)
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if ":devices:" in line:
            group = Path("/sys/fs/cgroup/devices", line.split(":", 2)[2].lstrip("/"))
            assert (group / "devices.list").read_text() == "", group


def test_a_hostile_guest_gets_nothing_of_the_host_from_its_volumes(
    node: NodeServer, volumes, sandboxes: Sandboxes
) -> None:
    from e2b import CommandExitException

    shared, small = volumes
    sandbox = sandboxes.create(volume_mounts={"/mnt/data": shared, "/mnt/small": small})
    (server,) = servers_of(node)
    assert_confined(server)

    # Raw 9P as the guest's unprivileged user, claiming uid 0: Tmknod of 1:11 (/dev/kmsg) refused.
    sandbox.files.write("/tmp/ninep_attack.py", ATTACK.read_text())
    said = run_in(
        sandbox, f"python3 /tmp/ninep_attack.py {GATEWAY_ADDRESS} {PORT} {export_path(shared.name)}"
    )
    results = json.loads(said)
    assert "ok" in results["attach"] and results["mknod"] == {"errno": EPERM}, results
    assert "read" not in results and "lopen" not in results, results
    # What remains (README): a claimed uid is trusted inside the volume, so it acts as the
    # guests' root there, and only there: the file is the range's host uid, not the host's root.
    assert results["owner"] == {"ok": [0, 0]}, results

    # mknod through the guest's own 9P mount, as the guest's root: refused, nothing made.
    with pytest.raises(CommandExitException):
        sandbox.commands.run("mknod /mnt/data/kmsg c 1 11", user="root")
    assert not shared.exists("/kmsg")
    run_in(sandbox, "mkfifo /mnt/data/fifo && rm /mnt/data/fifo")  # what is not a device still works

    # Filling a 16 MiB volume from the guest: ENOSPC, and what was there before stays.
    run_in(sandbox, "head -c 1048576 /dev/urandom > /mnt/small/kept && md5sum /mnt/small/kept > /tmp/sum")
    with pytest.raises(CommandExitException, match="No space left"):
        sandbox.commands.run("dd if=/dev/zero of=/mnt/small/fill bs=1M count=64 conv=fsync", timeout=120)
    run_in(sandbox, "md5sum -c /tmp/sum && rm /mnt/small/fill")
    assert small.get_info("/kept").size == 2**20

    # A tree 1,200 levels deep made by the guest: deleted through the content API, path and volume.
    deep = "python3 -c \"import os\nfor _ in range(1200): os.mkdir('d'); os.chdir('d')\nopen('f', 'w')\""
    run_in(sandbox, f"cd /mnt/data && {deep}", timeout=120)
    shared.remove("/d")
    assert not shared.exists("/d")
    run_in(sandbox, f"cd /mnt/small && {deep}", timeout=120)
    sandboxes.close()
    sandboxes.ids.clear()
    from e2b import Volume

    assert Volume.destroy(small.volume_id) is True
