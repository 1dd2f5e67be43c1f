"""Where aenv keeps its files: the build cache (guest artifacts) and the node's state."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """Content-addressed build cache, outside the repository so clones share it."""
    return Path(os.environ.get("AENV_CACHE_DIR") or Path.home() / ".cache" / "aenv")


def home_dir() -> Path:
    """Node state (VMs, snapshots, database); tests point it at a temporary directory."""
    return Path(os.environ.get("AENV_HOME_PATH") or os.environ.get("AENV_HOME") or "/var/lib/aenv")


def repository_dir(home: Path) -> Path:
    """A node home's repository: its templates and snapshots, the home's durable part."""
    return home / "repository"


def layers_dir(home: Path) -> Path:
    """A node home's qcow2 disk layers, kept beside the repository (they name their backing files
    by absolute path, see `aenv.runtime.layers`)."""
    return home / "layers"
