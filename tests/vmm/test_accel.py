"""The TSC options a guest under TCG boots with, from the host's /proc/cpuinfo and cpufreq."""

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


def _host(tmp_path: Path, cpuinfo: str, policies: int = 0) -> tuple[str, str]:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "cpuinfo").write_text(cpuinfo)
    cpufreq = tmp_path / "cpufreq"
    cpufreq.mkdir()
    for index in range(policies):
        (cpufreq / f"policy{index}").mkdir()
    return str(tmp_path / "cpuinfo"), str(cpufreq)


def test_a_host_that_knows_its_constant_tsc_rate_gives_it_and_marks_the_tsc_reliable(tmp_path: Path) -> None:
    assert tcg_clock_options(*_host(tmp_path, CPUINFO)) == "tsc_early_khz=2299998 tsc=reliable"


def test_the_watchdog_stays_where_the_rate_may_not_be_the_tsc_s(tmp_path: Path) -> None:
    """Cores that change speed make "cpu MHz" their current speed; a TSC that stops or changes
    rate, or whose rate the host calibrated, is left for the guest to judge."""
    assert tcg_clock_options(*_host(tmp_path / "a", CPUINFO, policies=2)) == "tsc_early_khz=2299998"
    for flag in (" nonstop_tsc", " tsc_known_freq"):
        assert tcg_clock_options(*_host(tmp_path / flag.strip(), CPUINFO.replace(flag, ""))) == (
            "tsc_early_khz=2299998"
        )
    assert tcg_clock_options(str(tmp_path / "missing"), str(tmp_path)) == ""
