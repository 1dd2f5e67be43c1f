"""Boot the real artifacts under QEMU: initramfs finds the disks by label, init starts envd,
and a SIGTERM to PID 1 shuts the guest down cleanly so QEMU (-no-reboot) exits by itself.

A stand-in envd is put on the tools drive: it prints what the guest looks like, then sends
SIGTERM to init, which keeps this test independent of the real envd.
"""

import subprocess
from pathlib import Path

import pytest

from aenv.guest import artifacts, tools
from aenv.vmm.accel import tcg_clock_options
from aenv.vmm.machine import MACHINE_TYPE

pytestmark = pytest.mark.vm

FAKE_ENVD = """\
import os, signal, subprocess, sys
probe = "id -u user; sudo -n -u user sudo -n true && echo sudo-ok; findmnt -no OPTIONS /opt/aenv; hostname; "\
    "/opt/aenv/bin/aenv-exec 2 100 - 0 echo exec-ok"
out = subprocess.run(["sh", "-c", probe], capture_output=True, text=True).stdout
print("FAKE-ENVD", sys.argv[1:], out.split(), flush=True)
subprocess.Popen(["sleep", "600"])  # must be terminated by init's shutdown
os.kill(1, signal.SIGTERM)
signal.pause()
"""


@pytest.fixture
def guest_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    package = tmp_path / "envd"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(FAKE_ENVD)
    monkeypatch.setattr(tools, "ENVD_SOURCE", package)
    image, _ = tools.ensure_tools()
    return image


def test_boot_to_envd_and_clean_shutdown(tmp_path: Path, guest_tools: Path) -> None:
    a = artifacts.ensure_guest_artifacts()
    upper = tmp_path / "upper.qcow2"
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(a.base_image), str(upper)],
        check=True,
    )
    serial = tmp_path / "serial.log"
    # As the launcher does under TCG: the guest gets the TSC rate instead of calibrating it
    # against the PIT, which can hang the boot on a busy host.
    cmdline = f"{a.kernel_cmdline} aenv.hostname=boot-test {tcg_clock_options()}"
    # The tools drive is attached first on purpose: init must not rely on the probe order.
    cmd = [
        "qemu-system-x86_64", "-M", MACHINE_TYPE, "-accel", "tcg,tb-size=64", "-cpu", "max",
        "-m", "512M", "-smp", "1", "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-kernel", str(a.kernel), "-initrd", str(a.initramfs),
        "-append", cmdline,
        "-drive", f"id=tools,file={guest_tools},format=raw,if=none,readonly=on",
        "-device", "virtio-blk-device,drive=tools",
        "-drive", f"id=root,file={upper},format=qcow2,if=none",
        "-device", "virtio-blk-device,drive=root",
        "-serial", f"file:{serial}",
    ]  # fmt: skip
    qemu = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    try:
        code = qemu.wait(timeout=180)
    finally:
        if qemu.poll() is None:
            qemu.kill()
            qemu.wait()
    log = serial.read_text(errors="replace")
    assert code == 0, log
    assert "aenv-initramfs: root /dev/vdb, tools /dev/vda" in log
    assert "envd started" in log
    envd_args = (
        "['--host-peer', '169.254.0.22', '--state-file', '/run/aenv/envd.json',"
        " '--exec-helper', '/opt/aenv/bin/aenv-exec']"
    )
    assert f"FAKE-ENVD {envd_args} ['1000', 'sudo-ok', 'ro,noatime', 'boot-test', 'exec-ok']" in log
    assert "shutting down (SIGTERM)" in log
    assert log.index("shutting down") < log.index("reboot")
    assert "Kernel panic" not in log, log
