"""Everything a sandbox VM boots from, built on demand and cached by content hash.

``ensure_guest_artifacts()`` is what the launcher calls; ``python -m aenv.guest.artifacts``
builds what is missing ahead of time and prints the paths. Disks: the launcher attaches the
root disk (an upper qcow2 on ``base_image``) and the tools disk (``tools_image``, read-only)
in any order: the initramfs finds them by ext4 label.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from aenv.guest.initramfs import ensure_initramfs
from aenv.guest.kernel import ensure_kernel
from aenv.guest.rootfs import ensure_rootfs
from aenv.guest.tools import ensure_tools

log = logging.getLogger(__name__)

# console on the serial port (the per-VM log); pci=off because microvm has no PCI bus and this
# kernel hangs early in boot under microvm without it (seen here under TCG); panic=-1 reboots at
# once on a panic, which ends QEMU (-no-reboot). The launcher appends per-VM aenv.* keys.
#
# The rest keeps an idle guest asleep: every wakeup of an idle sandbox costs its host CPU (under
# TCG, the emulated timer interrupt and the guest code it runs, ~4 QEMU thread wakeups each).
# Traced in an idle clone (ftrace, 10 s): ~12 timer interrupts/s, of which kcompactd's proactive
# compaction check every 500 ms (useless here: the guest has no transparent huge pages) and the
# soft-lockup watchdog every 4 s (a vCPU starved by its host trips it for nothing) are removed by
# `sysctl.vm.compaction_proactiveness=0` (the kernel then stops that timer, since 5.15) and
# `nowatchdog`. Traced again (20 s), the next ones were pressure-stall averaging every 2 s (`psi=0`:
# nothing in a sandbox reads /proc/pressure), the vmstat shepherd every 1 s (`vm.stat_interval`
# 10 s: /proc/meminfo may lag small changes by up to that; envd samples every 5 s) and the managed
# neighbour probe of the ARP and IPv6 tables every 5 s each (no aenv guest has managed neighbour
# entries). Together: host wakeups of an idle clone 24-26/s -> 17-18/s per QEMU thread, its CPU
# 0.26-0.31 % -> 0.20-0.25 % of a core (12 clones side by side, same run).
KERNEL_CMDLINE = (
    "console=ttyS0 quiet panic=-1 pci=off rdinit=/init nowatchdog sysctl.vm.compaction_proactiveness=0"
    " psi=0 init_on_free=1 sysctl.vm.stat_interval=10"
    " sysctl.net.ipv4.neigh.default.interval_probe_time_ms=3600000"
    " sysctl.net.ipv6.neigh.default.interval_probe_time_ms=3600000"
)


@dataclass(frozen=True)
class GuestArtifacts:
    """Paths the launcher passes to QEMU, and digests that identify each artifact's content."""

    kernel: Path
    initramfs: Path
    base_image: Path
    tools_image: Path
    kernel_cmdline: str
    kernel_release: str
    kernel_digest: str
    initramfs_digest: str
    base_image_digest: str
    tools_image_digest: str


def ensure_guest_artifacts() -> GuestArtifacts:
    """Build whatever is missing from the cache (unchanged inputs: nothing is rebuilt)."""
    started = time.monotonic()
    kernel = ensure_kernel()
    initramfs, initramfs_digest = ensure_initramfs(kernel)
    tools, tools_digest = ensure_tools()
    base, base_digest = ensure_rootfs()
    log.debug("guest artifacts ready in %.2f s", time.monotonic() - started)
    return GuestArtifacts(
        kernel=kernel.vmlinux,
        initramfs=initramfs,
        base_image=base,
        tools_image=tools,
        kernel_cmdline=KERNEL_CMDLINE,
        kernel_release=kernel.release,
        kernel_digest=kernel.digest,
        initramfs_digest=initramfs_digest,
        base_image_digest=base_digest,
        tools_image_digest=tools_digest,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="Build (if missing) and print aenv's guest artifacts.")
    parser.add_argument("--json", action="store_true", help="print the artifacts as JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    artifacts = ensure_guest_artifacts()
    fields = {k: str(v) for k, v in asdict(artifacts).items()}
    if args.json:
        print(json.dumps(fields, indent=2))
    else:
        for key, value in fields.items():
            print(f"{key:20} {value}")


if __name__ == "__main__":
    main()
