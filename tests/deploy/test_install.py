"""deploy/install.sh into a temporary root (--root: no apt, no systemctl start, the host left
alone): the venv with the package, config with fresh cluster secrets, units enabled, the `aenv`
user; a second run that keeps the configuration; uninstall, then purge. The units are checked
with `systemd-analyze verify`. Pip installs a wheel built here without its dependencies (the
layout is under test, not PyPI)."""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from .wiring import DEPLOY, REPO, read_env_file

SERVICES = ("server", "gateway", "scheduler")
ENABLED = ("gateway", "scheduler")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The aenv wheel, built from a copy of the tree (the build leaves nothing in the repository)."""
    tree = tmp_path_factory.mktemp("tree")
    shutil.copy(REPO / "pyproject.toml", tree)
    shutil.copytree(REPO / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out)]
    subprocess.run([*pip, str(tree)], check=True)
    return next(out.glob("aenv-*.whl"))


def install(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = ["bash", str(DEPLOY / "install.sh"), "--root", str(root), *args]
    return subprocess.run(command, check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    root = tmp_path_factory.mktemp("root")
    install(root, "--wheel", str(wheel), "--pip-args", "--no-deps --no-index", "--enable", ",".join(ENABLED))
    return root


def test_layout(root: Path) -> None:
    venv = root / "opt/aenv/bin"
    imported = subprocess.run([venv / "python", "-c", "import aenv"], check=False)
    assert imported.returncode == 0 and (venv / "aenv").exists()
    for name in SERVICES:
        assert (root / f"etc/systemd/system/aenv-{name}.service").is_file()
        assert (root / f"etc/aenv/{name}.env").is_file()
        enabled = root / f"etc/systemd/system/multi-user.target.wants/aenv-{name}.service"
        assert enabled.is_symlink() == (name in ENABLED)
    cluster = root / "etc/aenv/cluster.env"
    assert stat.S_IMODE(cluster.stat().st_mode) == 0o600
    secrets = read_env_file(cluster)
    assert secrets["AENV_API_KEY"].startswith("e2b_") and len(secrets["AENV_CLUSTER_SECRET"]) == 64
    assert "@" not in cluster.read_text()
    users = [line.split(":") for line in (root / "etc/passwd").read_text().splitlines()]
    assert [u[6] for u in users if u[0] == "aenv"] == ["/usr/sbin/nologin"]


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze is not installed")
def test_units_verify(root: Path, tmp_path: Path) -> None:
    """The installed units, their ExecStart pointed into the root (verify checks it exists)."""
    for name in SERVICES:
        text = (root / f"etc/systemd/system/aenv-{name}.service").read_text()
        (tmp_path / f"aenv-{name}.service").write_text(text.replace("/opt/aenv/", f"{root}/opt/aenv/"))
    units = sorted(str(p) for p in tmp_path.glob("*.service"))
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", *units], capture_output=True, text=True)
    assert result.returncode == 0 and not result.stderr, result.stderr


def test_rerun_keeps_configuration_then_uninstall_and_purge(root: Path, wheel: Path) -> None:
    server_env = root / "etc/aenv/server.env"
    server_env.write_text(server_env.read_text() + "AENV_WARM_POOL_SIZE=5\n")
    secrets = (root / "etc/aenv/cluster.env").read_text()
    install(root, "--wheel", str(wheel), "--pip-args", "--no-deps --no-index", "--enable", ",".join(ENABLED))
    assert "AENV_WARM_POOL_SIZE=5" in server_env.read_text()
    assert (root / "etc/aenv/cluster.env").read_text() == secrets
    assert (root / "etc/passwd").read_text().count("aenv:") == 1

    (root / "var/lib/aenv").mkdir(parents=True)
    install(root, "--uninstall")
    assert not (root / "opt/aenv").exists()
    assert not list((root / "etc/systemd/system").rglob("aenv-*"))
    assert (root / "etc/aenv/cluster.env").exists() and (root / "var/lib/aenv").exists()

    install(root, "--uninstall", "--purge")
    assert not (root / "etc/aenv").exists() and not (root / "var/lib/aenv").exists()
    assert "aenv:" not in (root / "etc/passwd").read_text()


def test_refuses_unknown_services(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(DEPLOY / "install.sh"), "--root", str(tmp_path), "--enable", "sever"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode != 0 and "sever" in result.stderr
    assert not any(tmp_path.iterdir())
