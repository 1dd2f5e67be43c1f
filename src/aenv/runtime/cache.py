"""The node's runtime cache: repository blobs materialized as local files, within a capacity.

The third storage tier (see `aenv.runtime.contract`): files QEMU maps and opens, fetched from
a remote repository on first use. Every entry records the snapshots it was fetched for
(`owners`); an entry is pinned while this node holds a lease on one of them (a sandbox, warm
VM or paused sandbox uses the snapshot), and for a short while after each use (so a file handed
out for a build or a start is not evicted before QEMU opens it). Cold entries are evicted least
recently used first when the cache is over capacity; when everything left is pinned the cache
stays over capacity rather than fail a start, and says so in its stats.

Usage is the space entries take on disk (sparse memory images count what they hold, not their
size). An entry may be partial: a memory image loaded on demand (`aenv.runtime.lazyfs`) is a
sparse file that another process fills chunk by chunk while VMs read it; it is pinned, counted
(by what it holds so far, growth counted as fetched) and evicted like any other, and
`on_evict` tells its owner so the file is no longer served. The index (owners, use order,
partial or not) is kept in ``index.json`` so a restarted node keeps the pins of its paused
sandboxes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

INDEX = "index.json"
RECENT_SECONDS = 120.0


@dataclass(frozen=True)
class CacheStats:
    """A point-in-time view of the cache for metrics (counters only ever grow)."""

    capacity_bytes: int
    used_bytes: int
    entries: int
    pinned_entries: int
    hits: int
    misses: int
    evictions: int
    fetched_bytes: int


@dataclass
class _Entry:
    size: int
    owners: set[str] = field(default_factory=set)
    used: float = field(default_factory=time.time)
    lazy: bool = False  # filled on demand: its file holds only what was read so far


class BlobCache:
    """Files named by key under ``root``, filled on a miss, evicted LRU when over capacity.

    `in_use()` returns the snapshot ids this node holds leases on; entries owned by one of them
    are never evicted.
    """

    def __init__(
        self, root: Path, capacity_bytes: int, in_use: Callable[[], set[str]],
        recent_seconds: float | None = None,
    ) -> None:  # fmt: skip
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.recent_seconds = RECENT_SECONDS if recent_seconds is None else recent_seconds
        self._in_use = in_use
        root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._filling: dict[str, threading.Lock] = {}
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.hits = self.misses = self.evictions = self.fetched_bytes = 0
        self.on_evict: Callable[[str], None] | None = None
        self._load()

    def path(self, key: str) -> Path:
        return self.root / key

    def get(self, key: str, fill: Callable[[Path], None], owner: str | None = None) -> Path:
        """The entry's file, filled by ``fill(tmp)`` on a miss; ``owner`` (a snapshot id) pins it."""
        with self._lock:
            if self._hit(key, owner):
                return self.path(key)
            key_lock = self._filling.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                if self._hit(key, owner):  # filled by another thread
                    return self.path(key)
            self._fill(key, fill, owner)
        with self._lock:
            self._filling.pop(key, None)
            self._evict(keep=key)
        return self.path(key)

    def get_partial(self, key: str, size: int, owner: str | None = None) -> tuple[Path, bool]:
        """A partial entry of `size` bytes (a sparse file, filled by its reader), made on a miss.

        Returns its file and whether it already was an entry (complete or partial: the caller
        serves a complete one in place).
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and self.path(key).exists():
                self.hits += 1
                self._touch(key, entry, owner)
                return self.path(key), True
            self.misses += 1
            with open(self.path(key), "wb") as f:
                f.truncate(size)
            _seal(self.path(key))
            self._entries[key] = _Entry(0, {owner} if owner else set(), lazy=True)
            self._evict(keep=key)  # saves the index
            return self.path(key), False

    def is_partial(self, key: str) -> bool:
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and entry.lazy

    def whole(self, key: str) -> Path | None:
        """The file of a complete entry (a partial one holds only what was read: None), for
        reading in place without counting a use: what a node serves its peers
        (`aenv.runtime.peers`). An entry evicted meanwhile leaves an open file readable."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.lazy or not self.path(key).exists():
                return None
            return self.path(key)

    def adopt(self, key: str, path: Path, owner: str | None = None) -> None:
        """Make an immutable local file an entry by hardlink (it was just stored from this node)."""
        with self._lock:
            if key in self._entries and self.path(key).exists():
                return
            tmp = self.root / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
            tmp.unlink(missing_ok=True)
            os.link(path, tmp)
            _seal(tmp)  # the file as its builder left it: owner-only, after QEMU wrote it
            os.replace(tmp, self.path(key))
            self._entries[key] = _Entry(_allocated(self.path(key)), {owner} if owner else set())
            self._save()
            self._evict(keep=key)

    def stats(self) -> CacheStats:
        with self._lock:
            self._measure_partial()
            pinned = self._pinned_keys()
            return CacheStats(
                capacity_bytes=self.capacity_bytes,
                used_bytes=sum(e.size for e in self._entries.values()),
                entries=len(self._entries),
                pinned_entries=len(pinned),
                hits=self.hits,
                misses=self.misses,
                evictions=self.evictions,
                fetched_bytes=self.fetched_bytes,
            )

    def keys(self) -> list[str]:
        """Entry keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    # ---- internals -------------------------------------------------------------------------

    def _fill(self, key: str, fill: Callable[[Path], None], owner: str | None) -> None:
        final = self.path(key)
        tmp = self.root / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.unlink(missing_ok=True)
        try:
            fill(tmp)
            _seal(tmp)
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        size = _allocated(final)
        with self._lock:
            self.misses += 1
            self.fetched_bytes += final.stat().st_size
            self._entries[key] = _Entry(size, {owner} if owner else set())
            self._save()

    def _hit(self, key: str, owner: str | None) -> bool:
        """A complete entry: counted as a hit and touched (a partial one is filled anew)."""
        entry = self._entries.get(key)
        if entry is None or entry.lazy or not self.path(key).exists():
            return False
        self.hits += 1
        self._touch(key, entry, owner)
        return True

    def _measure_partial(self) -> None:
        """Partial entries grow as they are read: their size now, the growth counted as fetched."""
        for key, entry in self._entries.items():
            if entry.lazy:
                try:
                    size = _allocated(self.path(key))
                except FileNotFoundError:
                    size = 0
                self.fetched_bytes += max(0, size - entry.size)
                entry.size = size

    def _touch(self, key: str, entry: _Entry, owner: str | None) -> None:
        entry.used = time.time()
        self._entries.move_to_end(key)
        if owner and owner not in entry.owners:
            entry.owners.add(owner)
            self._save()

    def _pinned_keys(self) -> set[str]:
        leased = self._in_use()
        recent = time.time() - self.recent_seconds
        return {k for k, e in self._entries.items() if e.owners & leased or e.used > recent}

    def _evict(self, keep: str) -> None:
        self._measure_partial()
        used = sum(e.size for e in self._entries.values())
        if used <= self.capacity_bytes:
            return
        pinned = self._pinned_keys() | {keep}
        for key in [k for k in self._entries if k not in pinned]:
            if used <= self.capacity_bytes:
                break
            entry = self._entries.pop(key)
            if entry.lazy and self.on_evict is not None:
                self.on_evict(key)
            self.path(key).unlink(missing_ok=True)
            used -= entry.size
            self.evictions += 1
        if used > self.capacity_bytes:
            log.warning(
                "runtime cache holds %d MiB over its %d MiB capacity: all of it is in use",
                (used - self.capacity_bytes) >> 20, self.capacity_bytes >> 20,
            )  # fmt: skip
        self._save()

    def _save(self) -> None:
        data = {k: dataclasses.asdict(e) | {"owners": sorted(e.owners)} for k, e in self._entries.items()}
        tmp = self.root / f".{INDEX}.tmp"
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.root / INDEX)

    def _load(self) -> None:
        """Entries left by an earlier run, with their owners; files without a record are unowned."""
        try:
            recorded = json.loads((self.root / INDEX).read_text())
        except (FileNotFoundError, ValueError):
            recorded = {}
        found = []
        for path in self.root.iterdir():
            if path.name.startswith("."):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()  # an interrupted fill
                continue
            if path.name == INDEX:
                continue
            info = recorded.get(path.name, {})
            owners, used = set(info.get("owners", [])), float(info.get("used", 0.0))
            entry = _Entry(_allocated(path), owners, used, bool(info.get("lazy")))
            found.append((entry.used, path.name, entry))
        for _, key, entry in sorted(found):
            self._entries[key] = entry


def _seal(path: Path) -> None:
    """Make an entry read-only and readable by anyone: QEMU opens it as an unprivileged VMM uid
    (`aenv.vmm.confine`), as it opens a posix repository's blobs, which are 0444 too."""
    os.chmod(path, 0o444)


def _allocated(path: Path) -> int:
    return path.stat().st_blocks * 512
