"""Kernel discovery and vmlinux extraction (real Debian kernel from /boot)."""

from pathlib import Path

import pytest

from aenv.guest import kernel


def test_find_kernel_prefers_configured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    custom = tmp_path / "my-vmlinux"
    custom.write_bytes(b"\x7fELF" + b"\0" * 60)
    monkeypatch.setenv("AENV_KERNEL", str(custom))
    assert kernel.find_kernel() == custom
    monkeypatch.setenv("AENV_KERNEL", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError):
        kernel.find_kernel()


def test_version_order() -> None:
    names = [Path("vmlinuz-6.1.0-9-amd64"), Path("vmlinuz-6.1.0-57-amd64"), Path("vmlinuz-6.1.0-10-amd64")]
    assert max(names, key=kernel._version_key).name == "vmlinuz-6.1.0-57-amd64"


def test_extracted_kernel_is_elf_with_release(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AENV_KERNEL", raising=False)
    k = kernel.ensure_kernel()
    with open(k.vmlinux, "rb") as f:
        assert f.read(4) == kernel.ELF_MAGIC
    assert (kernel.MODULES_ROOT / k.release).is_dir()
    assert kernel.find_kernel().name == f"vmlinuz-{k.release}"


def test_ready_vmlinux_is_used_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AENV_KERNEL", raising=False)
    extracted = kernel.ensure_kernel()
    monkeypatch.setenv("AENV_KERNEL", str(extracted.vmlinux))
    ready = kernel.ensure_kernel()
    assert ready.vmlinux == extracted.vmlinux
    assert ready.release == extracted.release


def test_non_kernel_is_rejected(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus"
    bogus.write_bytes(b"\0" * 4096)
    with pytest.raises(ValueError, match="bzImage"):
        kernel.extract_vmlinux(bogus, tmp_path / "out")
