"""TCG's translation buffer size on QEMU's command line (aenv.vmm.machine); KVM's has none."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.vmm import machine
from aenv.vmm.machine import MachineConfig


def accel_option(accel: str, tmp_path: Path) -> str:
    config = MachineConfig(kernel=tmp_path / "k", initramfs=tmp_path / "i", cmdline="", accel=accel)
    argv = config.argv(tap_fd=None, qmp_fd=3, workdir=tmp_path, incoming=False)
    return argv[argv.index("-accel") + 1]


def test_the_node_setting_sizes_tcg_translation_buffer_and_kvm_gets_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(machine, "_translation_cache_mib", machine.TCG_TRANSLATION_CACHE_MIB)
    assert accel_option("tcg", tmp_path) == "tcg,tb-size=64"
    machine.set_translation_cache(32)
    assert accel_option("tcg", tmp_path) == "tcg,tb-size=32"
    assert accel_option("kvm", tmp_path) == "kvm"
