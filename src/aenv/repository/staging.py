"""The builder tier: a local scratch directory captures are written in before they are stored.

Both backends keep it on local disk (a posix repository inside its root, so storing from it is
a hardlink; an s3 one beside the node's cache, so storing is an upload). Entries are made by
one repository instance and used by no other, so what that instance made is never cleaned
from under it, and what an earlier process left is removed once older than the grace period.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


class Staging:
    """One repository instance's view of its staging directory."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._own: set[Path] = set()

    def new_dir(self) -> Path:
        """A fresh scratch directory, this instance's until `discard`."""
        path = Path(tempfile.mkdtemp(prefix="s-", dir=self.root))
        self._own.add(path)
        return path

    def discard(self, path: Path) -> None:
        """Remove a directory made by `new_dir` (blobs stored from it are unaffected)."""
        self._own.discard(Path(path))
        shutil.rmtree(path, ignore_errors=True)

    @contextlib.contextmanager
    def temp_file(self) -> Iterator[Path]:
        """A temporary path, protected from cleanup while in use and removed after."""
        tmp = self.root / f".blob-{secrets.token_hex(8)}"
        self._own.add(tmp)
        try:
            yield tmp
        finally:
            tmp.unlink(missing_ok=True)
            self._own.discard(tmp)

    def cleanup(self, older_than: float) -> int:
        """Remove entries not made by this instance and older than ``older_than`` seconds."""
        cutoff = time.time() - older_than
        removed = 0
        for own in [p for p in list(self._own) if not p.exists()]:
            self._own.discard(own)  # removed by its user without discard
        for entry in self.root.iterdir():
            if entry in self._own:
                continue
            try:
                if entry.lstat().st_mtime > cutoff:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
            except FileNotFoundError:
                continue
            removed += 1
        return removed
