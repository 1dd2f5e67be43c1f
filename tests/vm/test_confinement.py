"""VMM confinement: the command line, cgroup v1 and v2 layouts on fake trees, and what a QEMU
a guest took over reaches on a real node (`test_an_escaped_qemu_reaches_nothing_of_the_host`).

Real VMs run confined in every VM test; tests/e2e/test_abuse.py checks their QEMU processes'
capabilities, seccomp mode and cgroup limits on a real node.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.config import Settings
from aenv.devnode import DevNode
from aenv.vmm import confine
from aenv.vmm.confine import CgroupTree, Confinement, IdentityError, Limits, RuntimeUser, VmmIdentities
from aenv.vmm.mountview import MountView

SLOT_FIRST, SLOT_COUNT = 11264, 32  # apart from every other node the suite starts
V1_PROC = "9:name=systemd:/\n8:pids:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n"
V2_PROC = "0::/system.slice/aenv.service\n"


def fake_v1(root: Path) -> CgroupTree:
    for controller in ("cpu", "memory", "pids"):
        (root / controller).mkdir(parents=True)
    tree = CgroupTree.detect(root, V1_PROC)
    assert tree is not None
    return tree


def fake_v2(root: Path) -> tuple[CgroupTree, Path]:
    """A v2 tree whose node group holds the node's process (pid 1234); the tree and that group."""
    (root / "cgroup.controllers").write_text("cpu memory pids")
    base = root / "system.slice/aenv.service"
    base.mkdir(parents=True)
    (base / "cgroup.procs").write_text("1234\n")
    (base / "cgroup.subtree_control").write_text("")
    tree = CgroupTree.detect(root, V2_PROC)
    assert tree is not None
    return tree, base


def test_command_drops_privileges_and_enables_seccomp() -> None:
    argv = Confinement(namespaces=False).command(["qemu-system-x86_64", "-M", "microvm"])
    assert argv[: len(confine.DROP_PRIVILEGES)] == list(confine.DROP_PRIVILEGES)
    assert argv[-2:] == ["-sandbox", confine.SECCOMP]
    plain = Confinement(seccomp=False, drop_privileges=False, namespaces=False).command(["qemu"])
    assert plain == ["qemu"]


def test_command_joins_the_mount_view_then_namespaces_of_its_own() -> None:
    argv = Confinement(mount_namespace="/proc/9/ns/mnt").command(["qemu"])
    assert argv[:3] == ["nsenter", "--mount=/proc/9/ns/mnt", "--"]
    after = 3 + len(confine.NAMESPACES)
    assert argv[3:after] == list(confine.NAMESPACES)
    assert argv[after : after + len(confine.DROP_PRIVILEGES)] == list(confine.DROP_PRIVILEGES)


def test_command_runs_qemu_as_its_own_uid() -> None:
    argv = Confinement(namespaces=False).command(["qemu"], RuntimeUser(uid=900, gid=901, groups=(107,)))
    real = f"--rgid={confine.REAL_GROUP}"
    assert argv[:5] == ["setpriv", "--reuid=900", real, "--egid=901", "--groups=107"]
    assert "--clear-groups" in Confinement(namespaces=False).command(["qemu"], RuntimeUser(900, 901))


def test_every_vmm_gets_a_uid_of_its_own_until_it_exits() -> None:
    identities = VmmIdentities(3_000_000, 3, groups=(107,))
    confinement = Confinement(identities=identities)
    first, second = confinement.identity(), confinement.identity()
    assert first == RuntimeUser(3_000_000, 3_000_000, (107,)) and second is not None
    assert second.uid == second.gid == 3_000_001
    confinement.give_back(first)
    third = confinement.identity()
    assert third is not None and third.uid == 3_000_002  # a freed uid is reused as late as possible
    assert confinement.identity() == first
    with pytest.raises(IdentityError, match="all 3"):
        confinement.identity()
    confinement.release(0, second)
    assert identities.in_use() == 2
    assert Confinement().identity() is None  # no range: QEMU stays uid 0, without capabilities


def test_a_uid_range_holding_host_users_is_refused() -> None:
    with pytest.raises(IdentityError, match="nobody"):
        VmmIdentities(65_000, 1024, groups=()).check_unused()  # nobody is 65534
    VmmIdentities(3_000_000, 1024, groups=()).check_unused()
    with pytest.raises(IdentityError, match="out of bounds"):
        VmmIdentities(2**31 - 10, 1024, groups=())


def test_a_handed_file_is_its_vmm_s_alone_and_taken_back(tmp_path: Path) -> None:
    layer = tmp_path / "top.qcow2"
    layer.write_bytes(b"disk")
    user = RuntimeUser(3_000_000, 3_000_000)
    Confinement.hand_over(layer, user)
    handed = layer.stat()
    assert (handed.st_uid, handed.st_gid, handed.st_mode & 0o777) == (user.uid, user.gid, 0o600)
    Confinement.reclaim(layer, user)
    assert layer.stat().st_uid == os.getuid() and layer.stat().st_mode & 0o777 == 0o600


def test_mount_view_holds_only_the_vm_directories(tmp_path: Path) -> None:
    """The view's root has the system, the given directories (behind a 0700 parent) and nothing else."""
    home = tmp_path / "home"
    writable, readable, secrets = home / "layers", home / "runtime", home / "secrets"
    for directory in (writable, readable, secrets):
        directory.mkdir(parents=True)
    (secrets / "api-key").write_text("key")
    (readable / "image").write_text("image")
    os.chmod(home, 0o700)
    nobody = RuntimeUser(uid=65534, gid=65533)  # a group apart from confine.REAL_GROUP
    view = MountView.start([writable], [readable])
    try:
        confined = Confinement(seccomp=False, mount_namespace=view.namespace)

        def run(script: str, user: RuntimeUser | None = nobody) -> subprocess.CompletedProcess[str]:
            argv = confined.command(["sh", "-c", script], user)
            return subprocess.run(argv, capture_output=True, text=True)

        assert run(f"id -u && cat {readable}/image").stdout == "65534\nimage"
        # Non-dumpable (real and effective group differ): its /proc files are root's, no peer traces
        # it. Not through sh, which makes its effective group its real one.
        owner = subprocess.run(
            confined.command(["stat", "-c", "%U", "/proc/self/mem"], nobody), capture_output=True
        )
        assert owner.stdout == b"root\n"
        assert run(f"touch {writable}/layer && echo ok", None).stdout == "ok\n"
        assert "Permission denied" in run(f"touch {writable}/other").stderr  # root's directory
        assert "Read-only" in run(f"touch {readable}/x", None).stderr
        assert "Read-only" in run("touch /etc/aenv-confinement-test", None).stderr
        assert "No such file" in run(f"cat {secrets}/api-key", None).stderr
        assert run(f"ls {home}", None).stdout.split() == ["layers", "runtime"]
        assert run("echo > /dev/null && head -c 1 /dev/urandom | wc -c").stdout == "1\n"
        assert run("qemu-system-x86_64 -version").returncode == 0
    finally:
        view.close()
    assert (writable / "layer").exists()
    assert view.process.returncode == 0


def test_privilege_drop_leaves_no_capabilities() -> None:
    status = subprocess.run(
        [*confine.DROP_PRIVILEGES, "cat", "/proc/self/status"], capture_output=True, text=True, check=True
    ).stdout
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    for name in ("CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(fields[name], 16) == 0, name
    assert fields["NoNewPrivs"].strip() == "1"


def test_qemu_accepts_the_seccomp_policy() -> None:
    out = subprocess.run(
        ["qemu-system-x86_64", "-sandbox", confine.SECCOMP, "-M", "none", "-display", "none", "-version"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr


def test_v1_layout_puts_groups_under_the_node_in_each_controller(tmp_path: Path) -> None:
    tree = fake_v1(tmp_path)
    assert tree.version == 1
    group = tree.group("vm-42")
    assert group["memory"] == tmp_path / "memory/process_api/abc/aenv/vm-42"
    assert group["cpu"] == tmp_path / "cpu/aenv/vm-42"
    tree.create("vm-42", Limits(vcpus=2, memory_mib=704, pids=256))
    assert (group["cpu"] / "cpu.cfs_quota_us").read_text() == "200000"
    assert (group["memory"] / "memory.limit_in_bytes").read_text() == str(704 * 2**20)
    assert (group["pids"] / "pids.max").read_text() == "256"


def test_v2_layout_delegates_controllers_and_moves_the_node_to_a_leaf(tmp_path: Path) -> None:
    tree, base = fake_v2(tmp_path)
    assert tree.version == 2
    tree.create("vm-7", Limits(vcpus=1, memory_mib=600, pids=64))
    assert (base / confine.V2_NODE_LEAF / "cgroup.procs").read_text() == "1234"
    assert "+memory" in (base / "cgroup.subtree_control").read_text()
    group = base / "aenv/vm-7"
    assert (group / "cpu.max").read_text() == "100000 100000"
    assert (group / "memory.max").read_text() == str(600 * 2**20)
    assert not (group / "memory.swap.max").exists()  # optional: not written where absent


def test_the_vms_weigh_against_the_node_in_v1_shares(tmp_path: Path) -> None:
    tree = fake_v1(tmp_path)
    tree.weigh(25)  # a quarter of the node's nice-0 1024
    assert (tmp_path / "cpu/aenv/cpu.shares").read_text() == "256"
    tree.weigh(1)
    assert (tmp_path / "cpu/aenv/cpu.shares").read_text() == "10"
    assert not (tmp_path / "memory/process_api/abc/aenv/cpu.shares").exists()  # the cpu tree's alone


def test_the_vms_weigh_against_the_node_leaf_in_v2(tmp_path: Path) -> None:
    tree, base = fake_v2(tmp_path)
    tree.weigh(20)
    assert (base / "aenv/cpu.weight").read_text() == "20"
    assert (base / confine.V2_NODE_LEAF / "cgroup.procs").read_text() == "1234"  # beside it, at 100


def test_detect_without_controllers(tmp_path: Path) -> None:
    assert CgroupTree.detect(tmp_path, V1_PROC) is None


def test_limits_add_the_vmm_overhead_to_guest_ram() -> None:
    limits = Confinement(memory_overhead_mib=100, pids=99).limits(vcpus=2, memory_mib=512)
    assert limits == Limits(vcpus=2, memory_mib=612, pids=99)


def _reaped() -> int:
    """The pid of a process that has exited and been reaped (no `/proc` entry)."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_groups_of_ended_vms_are_removed(tmp_path: Path) -> None:
    tree = fake_v1(tmp_path)
    confinement = Confinement(cgroups=tree)
    first, second = _reaped(), _reaped()
    for group in tree.group(confine.group_name(first)).values():
        group.mkdir(parents=True)
    confinement.release(first, None)
    assert not any(path.exists() for path in tree.group(f"vm-{first}").values())
    for group in tree.group(f"vm-{second}").values():
        group.mkdir(parents=True)
    assert tree.remove_unused() == 3


def test_the_empty_group_of_a_live_process_stays(tmp_path: Path) -> None:
    """A group is empty from its making until its QEMU joins it; another VM's end (on this node
    or another on the host) must not remove it in that instant."""
    tree = fake_v1(tmp_path)
    live = confine.group_name(os.getpid())
    for group in tree.group(live).values():
        group.mkdir(parents=True)
    assert tree.remove_unused() == 0
    assert all(path.exists() for path in tree.group(live).values())


def test_the_group_of_an_unreaped_process_goes(tmp_path: Path) -> None:
    """A QEMU whose node was killed may stay a zombie of its new parent: it has ended."""
    tree = fake_v1(tmp_path)
    zombie = subprocess.Popen(["true"])
    try:
        stat = Path(f"/proc/{zombie.pid}/stat")
        while stat.read_text().rpartition(")")[2].split()[0] != "Z":
            time.sleep(0.01)
        for group in tree.group(confine.group_name(zombie.pid)).values():
            group.mkdir(parents=True)
        assert tree.remove_unused() == 3
    finally:
        zombie.wait()


@pytest.mark.skipif(CgroupTree.detect() is None, reason="no cgroup controllers on this host")
def test_the_host_tree_accepts_a_group() -> None:
    configured = confine.from_settings(
        confine=True, cgroups=True, memory_overhead_mib=0, pids=16, mount_namespace=None, identities=None,
        cpu_weight=Settings.vmm_cpu_weight,  # the host's VMs share their parent group: as every node sets it
    )  # fmt: skip
    assert configured.cgroups is not None


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, template_seed: Path) -> Iterator[DevNode]:
    home = tmp_path_factory.mktemp("confinement") / "home"
    # No warm pool and no parking: every start and resume is a new QEMU loading a stream it is passed.
    settings = {"warm_pool_size": 0, "park_seconds": 0}
    with DevNode(home, slot_first=SLOT_FIRST, slot_count=SLOT_COUNT, seed=template_seed, **settings) as node:
        yield node


def _call(node: DevNode, method: str, path: str, **body: object) -> httpx.Response:
    headers = {"X-API-Key": node.key}
    response = httpx.request(method, f"{node.url}{path}", json=body or None, headers=headers, timeout=300)
    assert response.status_code < 300, response.text
    return response


def _state(node: DevNode, sandbox_id: str) -> dict[str, Any]:
    return json.loads((node.home / "sandboxes" / sandbox_id / "state.json").read_text())


def _host_address() -> str:
    """This host's address on its default route (a UDP socket's connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))
        return str(probe.getsockname()[0])


def _as_qemu(pid: int, script: str) -> subprocess.CompletedProcess[str]:
    """`script` run the way the QEMU `pid` runs: in its namespaces (mount, network, PID), as its uid
    and group, without capabilities."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    uid, gid = fields["Uid"].split()[0], fields["Gid"].split()[1]
    identity = [f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *confine.DROP_PRIVILEGES[1:]]
    argv = ["nsenter", f"--target={pid}", "--mount", "--net", "--pid", "--", "setpriv", *identity]
    return subprocess.run([*argv, "sh", "-c", script], capture_output=True, text=True, timeout=60)


@pytest.mark.vm
def test_an_escaped_qemu_reaches_nothing_of_the_host(node: DevNode) -> None:
    """As sandbox A's QEMU (its uid, its view, its namespaces): sandbox B's pause files are neither
    there nor readable on the host by another uid, the node API and a host loopback listener do not
    answer, and no host process is visible. B then resumes from those files (passed as descriptors)."""
    a, b = (_call(node, "POST", "/sandboxes", templateID="base").json()["sandboxID"] for _ in range(2))
    _call(node, "POST", f"/sandboxes/{b}/pause")
    b_dir = node.home / "sandboxes" / b
    assert b_dir.stat().st_uid == 0 and b_dir.stat().st_mode & 0o777 == 0o700  # no other uid enters it
    pause = [path for path in b_dir.iterdir() if path.suffix in (".delta", ".devices")]
    private = [*pause, *(b_dir / name for name in ("state.json", "serial.log", "qemu.log"))]
    assert len(pause) == 2 and all(path.stat().st_mode & 0o077 == 0 for path in private), [
        (path.name, oct(path.stat().st_mode)) for path in private
    ]
    pid = int(_state(node, a)["pid"])
    listener = socket.create_server(("0.0.0.0", 0))  # on every host address, loopback included
    try:
        port = listener.getsockname()[1]
        probe = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)"
        checks = {
            "uid": "id -u",
            "sandboxes": f"ls {node.home / 'sandboxes'}",
            "pause delta": f"head -c 1 {_state(node, b)['delta']}",
            "node api": f'python3 -c "{probe}" 127.0.0.1 {node.port}',
            "host loopback": f'python3 -c "{probe}" 127.0.0.1 {port}',
            "host network": f'python3 -c "{probe}" {_host_address()} {port}',
            "processes": "cat /proc/[0-9]*/comm | sort -u | xargs",
            "pid 1": "cat /proc/1/comm",
            "own layer": f"head -c 3 {node.home / 'layers' / _state(node, a)['disk_layers'][-1]}.qcow2",
            "layers": f"ls {node.home / 'layers'}",
            "interfaces": "tail -n +3 /proc/net/dev",
        }
        done = {name: _as_qemu(pid, script) for name, script in checks.items()}
    finally:
        listener.close()
    assert done["uid"].stdout.strip() not in ("", "0"), done["uid"]
    for name in ("sandboxes", "pause delta"):
        assert "No such file" in done[name].stderr, done[name]
    for name in ("node api", "host loopback", "host network"):
        assert "Network is unreachable" in done[name].stderr, done[name]
    visible = set(done["processes"].stdout.split())  # QEMU (pid 1) and this script's processes
    assert "qemu-system-x86" in visible and visible <= {"qemu-system-x86", "sh", "cat", "sort", "xargs"}, (
        visible
    )
    assert done["pid 1"].stdout.strip().startswith("qemu-system"), done["pid 1"]
    assert done["own layer"].stdout == "QFI", done["own layer"]  # its own top layer, a qcow2
    assert "Permission denied" in done["layers"].stderr, done["layers"]  # but no list of the others
    assert done["interfaces"].stdout.split()[:1] == ["lo:"], done["interfaces"]  # an empty network
    _call(node, "POST", f"/sandboxes/{b}/resume")
    assert _state(node, b)["paused"] is False
    for sandbox in (a, b):
        _call(node, "DELETE", f"/sandboxes/{sandbox}")
