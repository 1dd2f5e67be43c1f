"""The runtime cache: fills on a miss, LRU eviction within capacity, pins by lease, counters."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from aenv.runtime import cache as cache_mod
from aenv.runtime.cache import BlobCache

MIB = 1 << 20


def filler(data: bytes, calls: list[str] | None = None):
    def fill(dest: Path) -> None:
        if calls is not None:
            calls.append(dest.name)
        dest.write_bytes(data)

    return fill


@pytest.fixture(autouse=True)
def no_recent_protection(monkeypatch):
    """Entries are otherwise pinned for a while after each use; these tests pin by lease only."""
    monkeypatch.setattr(cache_mod, "RECENT_SECONDS", -1.0)


def test_miss_then_hits_and_one_fill_per_key(tmp_path: Path):
    calls: list[str] = []
    cache = BlobCache(tmp_path / "c", 10 * MIB, set)
    threads = [
        threading.Thread(target=cache.get, args=("a", filler(b"x" * MIB, calls), "s1")) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and cache.path("a").read_bytes() == b"x" * MIB
    stats = cache.stats()
    assert (stats.misses, stats.hits, stats.entries, stats.fetched_bytes) == (1, 3, 1, MIB)
    assert stats.used_bytes >= MIB and stats.capacity_bytes == 10 * MIB


def test_least_recently_used_cold_entries_are_evicted_first(tmp_path: Path):
    leased: set[str] = set()
    cache = BlobCache(tmp_path / "c", 3 * MIB, lambda: leased)
    for key in ("a", "b", "c"):
        cache.get(key, filler(b"1" * MIB), owner=f"snap-{key}")
    cache.get("a", filler(b"unused"))  # a is now the most recently used
    leased.add("snap-b")  # b is in use by a sandbox
    cache.get("d", filler(b"2" * MIB), owner="snap-d")
    assert cache.keys() == ["b", "a", "d"]  # c, the coldest unpinned, went
    assert not cache.path("c").exists() and cache.stats().evictions == 1
    cache.get("e", filler(b"3" * MIB), owner="snap-e")
    assert "b" in set(cache.keys()) and cache.stats().used_bytes <= 3 * MIB + 64 * 1024


def test_pinned_entries_stay_even_over_capacity(tmp_path: Path):
    leased = {"s1"}
    cache = BlobCache(tmp_path / "c", MIB, lambda: leased)
    cache.get("a", filler(b"1" * MIB), owner="s1")
    cache.get("b", filler(b"2" * MIB), owner="s1")
    stats = cache.stats()
    assert stats.evictions == 0 and stats.pinned_entries == 2 and stats.used_bytes > stats.capacity_bytes
    leased.clear()
    cache.get("c", filler(b"3" * (MIB // 2)))
    assert cache.keys() == ["c"] and cache.stats().evictions == 2


def test_a_failed_fill_leaves_nothing(tmp_path: Path):
    cache = BlobCache(tmp_path / "c", MIB, set)

    def broken(dest: Path) -> None:
        dest.write_bytes(b"half")
        raise OSError("connection reset")

    with pytest.raises(OSError):
        cache.get("a", broken)
    assert cache.keys() == [] and list((tmp_path / "c").iterdir()) == []
    assert cache.get("a", filler(b"whole")).read_bytes() == b"whole"


def test_owners_and_order_survive_a_restart(tmp_path: Path):
    cache = BlobCache(tmp_path / "c", 2 * MIB, set)
    cache.get("a", filler(b"1" * MIB), owner="paused-snap")
    cache.get("b", filler(b"2" * MIB), owner="other")
    again = BlobCache(tmp_path / "c", 2 * MIB, lambda: {"paused-snap"})
    assert again.keys() == ["a", "b"]
    again.get("c", filler(b"3" * MIB))
    assert again.keys() == ["a", "c"]  # a is pinned by the lease its owner still holds


def test_a_local_file_is_adopted_without_a_fetch(tmp_path: Path):
    cache = BlobCache(tmp_path / "c", 10 * MIB, set)
    image = tmp_path / "memory.img"
    image.write_bytes(b"built here")
    cache.adopt("d1", image, owner="s1")
    image.unlink()  # stored and removed from staging: the cache keeps the only copy
    assert cache.get("d1", filler(b"downloaded")).read_bytes() == b"built here"
    assert (cache.stats().misses, cache.stats().hits) == (0, 1)


def test_an_adopted_file_is_readable_by_every_vmm_uid(tmp_path: Path):
    """A memory image its builder left owner-only (0600) becomes an entry QEMU can open as an
    unprivileged VMM uid, as a fetched one is (issue 32: every create answered 500)."""
    built = tmp_path / "memory.img"
    built.write_bytes(b"m" * MIB)
    built.chmod(0o600)
    cache = BlobCache(tmp_path / "c", 10 * MIB, set)
    cache.adopt("image", built, owner="snap")
    cache.get("fetched", filler(b"f"))
    assert {cache.path(key).stat().st_mode & 0o777 for key in ("image", "fetched")} == {0o444}
