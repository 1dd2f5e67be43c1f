"""Guest kernel: find it and extract the uncompressed ELF ``vmlinux`` that QEMU boots by PVH.

PVH boot of the ELF skips the real-mode setup and the in-guest decompressor, which under TCG
is most of the boot time (2.0 s against 5.2 s for the bzImage; docs/design.md, Platform). The
default kernel is the newest ``/boot/vmlinuz-*`` (Debian's linux-image-amd64) that has its modules
installed; ``AENV_KERNEL`` names another bzImage or a ready vmlinux.
"""

from __future__ import annotations

import gzip
import lzma
import os
import re
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from aenv.guest.cache import cached_build, file_digest, inputs_key

ELF_MAGIC = b"\x7fELF"
MODULES_ROOT = Path("/lib/modules")
PRODUCT = "vmlinux"


@dataclass(frozen=True)
class Kernel:
    """An extracted kernel: what QEMU boots, the release its modules belong to, its identity."""

    vmlinux: Path
    release: str
    digest: str


def _version_key(path: Path) -> list[int | str]:
    """Sort key that orders 6.1.0-57 after 6.1.0-9 (numeric parts compare as numbers)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def find_kernel() -> Path:
    """The configured kernel (``AENV_KERNEL``), else the newest /boot/vmlinuz-* with modules."""
    configured = os.environ.get("AENV_KERNEL")
    if configured:
        path = Path(configured)
        if not path.is_file():
            raise FileNotFoundError(f"AENV_KERNEL={configured} is not a file")
        return path
    boot = Path("/boot").glob("vmlinuz-*")
    candidates = [p for p in boot if (MODULES_ROOT / p.name.removeprefix("vmlinuz-")).is_dir()]
    if not candidates:
        raise FileNotFoundError(
            "no /boot/vmlinuz-* with modules in /lib/modules: install linux-image-amd64 "
            "(scripts/install-host-deps.sh) or set AENV_KERNEL"
        )
    return max(candidates, key=_version_key)


def _payload(bzimage: bytes) -> bytes:
    """The compressed kernel inside a bzImage, located through the x86 boot setup header."""
    if bzimage[0x202:0x206] != b"HdrS":
        raise ValueError("not a bzImage (no HdrS setup header)")
    setup_sects = bzimage[0x1F1] or 4
    offset, length = struct.unpack_from("<II", bzimage, 0x248)
    start = (setup_sects + 1) * 512 + offset
    return bzimage[start : start + length]


def _decompress(payload: bytes) -> bytes:
    if payload.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMADecompressor().decompress(payload)
    if payload.startswith(b"\x1f\x8b"):
        return gzip.decompress(payload)
    if payload.startswith(b"\x28\xb5\x2f\xfd"):
        return subprocess.run(["zstd", "-dcq"], input=payload, capture_output=True, check=True).stdout
    raise ValueError(f"unsupported kernel compression (payload starts {payload[:6].hex()})")


def extract_vmlinux(kernel: Path, out: Path) -> None:
    """Write the ELF vmlinux of ``kernel`` (a bzImage or already an ELF) to ``out``."""
    data = kernel.read_bytes()
    vmlinux = data if data.startswith(ELF_MAGIC) else _decompress(_payload(data))
    if not vmlinux.startswith(ELF_MAGIC):
        raise ValueError(f"{kernel}: extracted kernel is not an ELF image")
    out.write_bytes(vmlinux)


def kernel_release(vmlinux: Path) -> str:
    """The release string (``uname -r``) from the kernel's banner, naming its modules directory."""
    match = re.search(rb"Linux version (\d[^\s\x00]*)", vmlinux.read_bytes())
    if not match:
        raise ValueError(f"{vmlinux}: no 'Linux version' banner found")
    return match.group(1).decode()


def ensure_kernel() -> Kernel:
    """Extract (once per kernel file, cached) and describe the guest kernel."""
    source = find_kernel()
    source_digest = file_digest(source)
    with open(source, "rb") as f:
        ready = f.read(4) == ELF_MAGIC
    if ready:  # a ready vmlinux is booted in place: nothing to extract
        return Kernel(source, kernel_release(source), source_digest)
    key = inputs_key(kernel=source_digest, builder=file_digest(Path(__file__)))

    def build(tmp: Path) -> None:
        extract_vmlinux(source, tmp / PRODUCT)
        (tmp / "release").write_text(kernel_release(tmp / PRODUCT))
        (tmp / "source").write_text(str(source))

    directory = cached_build("kernel", key, build, PRODUCT)
    return Kernel(directory / PRODUCT, (directory / "release").read_text().strip(), key)
