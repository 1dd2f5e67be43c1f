"""Content-addressed build cache for guest artifacts.

Every artifact lives in ``<cache_dir>/<kind>/<key>/`` where ``key`` hashes all inputs of its
build. A build runs in a temporary sibling directory that is renamed into place only when it
completed, so an interrupted build never leaves a half artifact behind; a per-key file lock
keeps concurrent callers (several test workers, a server and the CLI) from building twice.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from aenv.paths import cache_dir
from aenv.repository.files import file_digest as repository_digest

log = logging.getLogger(__name__)


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes, as bare hex (the repository's digest without its `sha256:`)."""
    return repository_digest(path).removeprefix("sha256:")


def tree_digest(root: Path, pattern: str = "*") -> str:
    """sha256 over relative paths and contents of the files under ``root`` (missing root: empty)."""
    h = hashlib.sha256()
    if root.is_dir():
        for path in sorted(p for p in root.rglob(pattern) if p.is_file() and "__pycache__" not in p.parts):
            h.update(str(path.relative_to(root)).encode() + b"\0")
            h.update(file_digest(path).encode() + b"\0")
    return h.hexdigest()


def inputs_key(**inputs: str | int | Iterable[str]) -> str:
    """Stable hash of named build inputs; any change of any input gives another key."""
    canonical = {k: (v if isinstance(v, str | int) else list(v)) for k, v in inputs.items()}
    return hashlib.sha256(json.dumps(canonical, sort_keys=True).encode()).hexdigest()[:32]


def cached_build(kind: str, key: str, build: Callable[[Path], None], product: str) -> Path:
    """Return ``<cache>/<kind>/<key>``, building it with ``build(tmpdir)`` first if it is missing.

    ``product`` names the file that must exist in the directory for it to count as complete.
    """
    parent = cache_dir() / kind
    final = parent / key
    if (final / product).exists():
        return final
    parent.mkdir(parents=True, exist_ok=True)
    with open(parent / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / product).exists():  # another process built it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", suffix=".tmp", dir=parent))
        started = time.monotonic()
        log.info("building %s %s", kind, key)
        try:
            build(tmp)
            if not (tmp / product).exists():
                raise RuntimeError(f"{kind} build did not produce {product}")
            tmp.chmod(0o755)  # mkdtemp makes it private; the artifacts are meant to be shared
            if final.exists():  # leftover without its product: never complete, replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        log.info("built %s %s in %.1f s", kind, key, time.monotonic() - started)
    return final
