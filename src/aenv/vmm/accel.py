"""Choose the accelerator: KVM where it works, QEMU's TCG where it does not.

Hosts whose /dev/kvm is PVM (paravirtualised KVM, `/sys/module/kvm_pvm`) cannot run stock
guest kernels under KVM, so `auto` falls back to TCG there with one warning.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger(__name__)

Accelerator = Literal["kvm", "tcg"]


@dataclass(frozen=True)
class AcceleratorChoice:
    accel: Accelerator
    reason: str


def _kvm_problem() -> str | None:
    """Why KVM cannot run our guests here, or None when it can."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return f"/dev/kvm is not usable ({exc.strerror})"
    os.close(fd)
    if os.path.exists("/sys/module/kvm_pvm"):
        return "/dev/kvm is PVM (kvm_pvm), which stock guest kernels cannot boot under"
    return None


@functools.cache
def choose_accelerator(setting: str = "auto") -> AcceleratorChoice:
    """Resolve `auto`, `kvm` or `tcg` (from config or AENV_ACCEL) into the accelerator to use."""
    setting = (setting or "auto").lower()
    if setting == "tcg":
        return AcceleratorChoice("tcg", "forced by configuration")
    problem = _kvm_problem()
    if setting == "kvm":
        if problem:
            raise RuntimeError(f"accelerator kvm was requested but {problem}")
        return AcceleratorChoice("kvm", "forced by configuration")
    if setting != "auto":
        raise ValueError(f"unknown accelerator {setting!r}: use auto, kvm or tcg")
    if problem:
        log.warning("using TCG (software emulation, much slower): %s", problem)
        return AcceleratorChoice("tcg", problem)
    return AcceleratorChoice("kvm", "/dev/kvm is available")


def default_vcpus(accel: Accelerator) -> int:
    """vCPUs per guest when not configured: 2 under KVM, as E2B's default, 1 under TCG.

    Under TCG on a busy host the guest kernel sometimes hangs bringing up a second vCPU
    ("Booting SMP configuration"), and every vCPU is a host thread emulating a CPU.
    """
    return 2 if accel == "kvm" else 1


def host_tsc_khz() -> int | None:
    """The host's TSC frequency as /proc/cpuinfo reports it, for guests under TCG.

    Under TCG the guest's TSC runs at the host's rate, but the guest kernel calibrates it against
    the emulated PIT, which fails on a busy host and can hang the boot; telling the guest the
    frequency (`tsc_early_khz=`) makes calibration unnecessary.
    """
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("cpu MHz"):
                    return round(float(line.split(":", 1)[1]) * 1000)
    except (OSError, ValueError):
        pass
    return None


def accelerator_from_env() -> AcceleratorChoice:
    return choose_accelerator(os.environ.get("AENV_ACCEL", "auto"))
