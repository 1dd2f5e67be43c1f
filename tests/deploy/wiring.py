"""What the deployment tests share: where the deploy files are, the settings they may name, and
the environment a service gets from them, checked by the node's own settings loader."""

from __future__ import annotations

import re
import subprocess
from dataclasses import fields
from pathlib import Path

from aenv.config import Settings, load_settings

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
VARIABLE = re.compile(r"\bAENV_[A-Z0-9_]*[A-Z0-9]\b")
SETTINGS = frozenset(f"AENV_{f.name.upper()}" for f in fields(Settings))
# Read by the process outside Settings (build cache, guest artifacts, QEMU binary, the settings
# file, the CLI's target node); each must still be read in src (test_documented_variables).
PROCESS_VARIABLES = frozenset(
    {"AENV_CACHE_DIR", "AENV_CONFIG_PATH", "AENV_INITRAMFS", "AENV_KERNEL", "AENV_QEMU", "AENV_URL"}
)


def variables(text: str) -> set[str]:
    """Every AENV_* name a text mentions."""
    return set(VARIABLE.findall(text))


def read_env_file(path: Path) -> dict[str, str]:
    """A systemd/Compose env file: KEY=VALUE lines, comments and blank lines skipped."""
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line and line[0] != "#")
    return {key: value for key, value in pairs}


def generated_secrets() -> dict[str, str]:
    """What deploy/compose/secrets.sh makes (Compose's secrets.env, the Kubernetes Secret)."""
    script = DEPLOY / "compose" / "secrets.sh"
    out = subprocess.run(["sh", str(script)], check=True, capture_output=True, text=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines())


def service_settings(environ: dict[str, str]) -> Settings:
    """The settings a service started with `environ` gets (raises ConfigError as it would)."""
    unknown = {name for name in environ if name.startswith("AENV_")} - SETTINGS - PROCESS_VARIABLES
    assert not unknown, f"not settings: {sorted(unknown)}"
    return load_settings(environ)


def image_environment() -> dict[str, str]:
    """The AENV_* variables the image sets (its Containerfile's ENV instruction)."""
    text = (DEPLOY / "image" / "Containerfile").read_text().replace("\\\n", " ")
    words = (word for line in text.splitlines() if line.startswith("ENV ") for word in line.split()[1:])
    return dict(word.split("=", 1) for word in words if word.startswith("AENV_"))
