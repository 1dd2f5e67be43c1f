"""Choose the accelerator: KVM where it works, QEMU's TCG where it does not.

Hosts whose /dev/kvm is PVM (paravirtualised KVM, `/sys/module/kvm_pvm`) cannot run stock
guest kernels under KVM, so `auto` falls back to TCG there with one warning.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
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


def tcg_clock_options(
    cpuinfo: str = "/proc/cpuinfo", cpufreq: str = "/sys/devices/system/cpu/cpufreq"
) -> str:
    """Kernel command-line options about the TSC for a guest under TCG, whose TSC is the host's.

    - `tsc_early_khz=`: the host's TSC rate. The guest kernel would otherwise calibrate it
      against the emulated PIT, which fails on a busy host and can hang the boot.
    - `tsc=reliable`. Without it the kernel's clocksource watchdog compares the TSC with the
      jiffies, from the boot on. Emulated timer interrupts arrive late on a busy host, so the
      watchdog sometimes marks the TSC unstable and falls back to `refined-jiffies`. Without a
      high-resolution clocksource an idle guest cannot stop its tick: 251 timer interrupts a
      second instead of 4. A template booted that way passes the periodic tick on to every
      sandbox restored from it. Measured with 20 idle sandboxes on a fresh node: 2.86 % of a
      core each on the jiffies, 0.26 % on the TSC with the watchdog's own timer, 0.13 % with
      `tsc=reliable`.

    The watchdog is only turned off where the rate given is the TSC's for certain, since the
    guest's clock would run at the wrong speed otherwise. That is where the host's TSC runs at one
    rate (`constant_tsc`, `nonstop_tsc`), its kernel knows that rate rather than calibrating it
    (`tsc_known_freq`), and no cpufreq driver scales its cores: "cpu MHz" then reports that rate,
    as in a VM. On a host whose cores change speed, "cpu MHz" is the current speed of a core.
    """
    khz, flags = None, set()
    try:
        with open(cpuinfo) as lines:
            for line in lines:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "cpu MHz" and khz is None:
                    khz = round(float(value) * 1000)
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except (OSError, ValueError):
        pass
    if not khz:
        return ""
    scaled = any(Path(cpufreq).glob("policy*"))
    exact = {"constant_tsc", "nonstop_tsc", "tsc_known_freq"} <= flags and not scaled
    return f"tsc_early_khz={khz}" + (" tsc=reliable" if exact else "")


def accelerator_from_env() -> AcceleratorChoice:
    return choose_accelerator(os.environ.get("AENV_ACCEL", "auto"))
