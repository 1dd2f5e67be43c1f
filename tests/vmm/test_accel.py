"""The TSC options a guest under TCG boots with, from the host's /proc/cpuinfo."""

from pathlib import Path

from aenv.vmm.accel import tcg_clock_options

CPUINFO = """\
processor\t: 0
cpu MHz\t\t: 2299.998
flags\t\t: fpu tsc constant_tsc nonstop_tsc tsc_known_freq
processor\t: 1
cpu MHz\t\t: 2100.000
flags\t\t: fpu
"""


def test_a_constant_host_tsc_is_given_with_its_rate_and_marked_reliable(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO)
    assert tcg_clock_options(str(cpuinfo)) == "tsc_early_khz=2299998 tsc=reliable"


def test_a_tsc_that_may_stop_or_change_rate_is_left_to_the_guest_to_judge(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO.replace(" nonstop_tsc", ""))
    assert tcg_clock_options(str(cpuinfo)) == "tsc_early_khz=2299998"
    assert tcg_clock_options(str(tmp_path / "missing")) == ""
