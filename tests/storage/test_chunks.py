"""On-demand loading without a VM: chunk indexes, verified chunk fills, partial cache entries,
and the FUSE server reading a blob from a real SeaweedFS as a mapping touches it."""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import signal
from pathlib import Path

import pytest

from aenv.devs3 import S3Server
from aenv.repository.chunks import ChunkFile, ChunkIndex, ChunkMismatch, held_chunks, runs
from aenv.runtime.cache import BlobCache
from aenv.runtime.lazyfs import LazyMount, server_pid
from tests.conftest import wait_for

C = 64 << 10  # a small chunk size keeps the files small


def blob_file(path: Path, chunks: dict[int, int], count: int) -> bytes:
    """A sparse file of `count` chunks; chunk i filled with byte chunks[i], the others holes."""
    with open(path, "wb") as f:
        f.truncate(count * C)
        for i, value in chunks.items():
            f.seek(i * C)
            f.write(bytes([value]) * C)
    return path.read_bytes()


class Remote:
    """The blob's bytes behind ranged reads, counting them (a corrupt copy if told to)."""

    def __init__(self, data: bytes):
        self.data = bytearray(data)
        self.reads: list[tuple[int, int]] = []

    def __call__(self, offset: int, length: int) -> bytes:
        self.reads.append((offset, length))
        return bytes(self.data[offset : offset + length])


def test_an_index_names_each_data_chunk_and_skips_zeros(tmp_path: Path):
    blob_file(tmp_path / "b", {1: 7, 2: 8, 5: 9}, count=8)
    index = ChunkIndex.build(tmp_path / "b", chunk_size=C)
    assert index.size == 8 * C and index.data_chunks() == [1, 2, 5]
    assert index.digests[1] == hashlib.sha256(bytes([7]) * C).hexdigest()
    assert ChunkIndex.from_json(index.to_json()) == index
    assert runs([5, 1, 2, 3, 9], max_run=2) == [(1, 2), (3, 1), (5, 1), (9, 1)]
    assert list(index.chunks_of(C - 1, 2)) == [0, 1] and list(index.chunks_of(8 * C, 10)) == []


def test_reads_fetch_only_the_chunks_they_touch_verified(tmp_path: Path):
    data = blob_file(tmp_path / "b", {1: 7, 2: 8, 5: 9}, count=8)
    index = ChunkIndex.build(tmp_path / "b", chunk_size=C)
    remote = Remote(data)
    (tmp_path / "copy").touch()  # made by its cache
    copy = ChunkFile(tmp_path / "copy", index, remote)
    assert copy.read(C + 10, 2 * C) == data[C + 10 : 3 * C + 10]  # chunks 1-3: 1 and 2 fetched
    assert remote.reads == [(C, 2 * C)]  # one ranged read for the run, the zero chunk 3 never
    assert copy.read(3 * C, C) == bytes(C) and len(remote.reads) == 1
    assert held_chunks(tmp_path / "copy", index) == [1, 2]
    # Another process (a restarted server) trusts nothing it did not check: chunks it finds
    # intact are served without a fetch, a damaged one is fetched again.
    with open(tmp_path / "copy", "r+b") as f:
        f.seek(2 * C + 5)
        f.write(b"X")
    again = ChunkFile(tmp_path / "copy", index, remote)
    assert again.read(C, 2 * C) == data[C : 3 * C]
    assert remote.reads[1:] == [(2 * C, C)]
    again.prefetch([5])
    assert remote.reads[2:] == [(5 * C, C)] and again.read(5 * C, C) == data[5 * C : 6 * C]
    # Once its cache dropped the copy, reads are still served (verified) but nothing is kept.
    (tmp_path / "copy").unlink()
    assert again.read(C, 10) == data[C : C + 10] and not (tmp_path / "copy").exists()


def test_a_corrupt_chunk_is_an_error_never_data(tmp_path: Path):
    data = blob_file(tmp_path / "b", {0: 1, 1: 2}, count=2)
    index = ChunkIndex.build(tmp_path / "b", chunk_size=C)
    remote = Remote(data)
    remote.data[C + 3] ^= 0xFF
    (tmp_path / "copy").touch()
    copy = ChunkFile(tmp_path / "copy", index, remote)
    assert copy.read(0, 10) == data[:10]
    with pytest.raises(ChunkMismatch, match="chunk 1"):
        copy.read(C, 10)
    assert held_chunks(tmp_path / "copy", index) == [0]  # nothing of the bad chunk was written
    (tmp_path / "copy").unlink()
    with pytest.raises(ChunkMismatch, match="chunk 1"):
        copy.read(C, 10)


def test_partial_entries_are_counted_pinned_and_evicted(tmp_path: Path):
    leased = {"snap-a"}
    evicted: list[str] = []
    cache = BlobCache(tmp_path / "cache", 3 * C, lambda: leased, recent_seconds=-1)
    cache.on_evict = evicted.append
    path, existed = cache.get_partial("img", 16 * C, "snap-a")
    assert not existed and cache.is_partial("img") and path.stat().st_size == 16 * C
    assert cache.stats().used_bytes == 0  # a sparse file holds nothing yet
    with open(path, "r+b") as f:  # its reader fills four chunks
        for i in range(4):
            f.seek(i * C)
            f.write(b"m" * C)
    stats = cache.stats()
    assert stats.used_bytes >= 4 * C and stats.fetched_bytes >= 4 * C and stats.misses == 1
    cache.get("small", lambda dest: dest.write_bytes(b"s" * C), "snap-b")  # over capacity now
    assert cache.keys() == ["img", "small"] and evicted == []  # the leased partial entry stays
    restarted = BlobCache(tmp_path / "cache", 3 * C, lambda: leased, recent_seconds=-1)
    assert restarted.is_partial("img")  # kept across a restart
    leased.clear()
    cache.get("other", lambda dest: dest.write_bytes(b"o" * C))
    assert evicted == ["img"] and "img" not in list(cache.keys()) and not path.exists()
    # A partial entry asked for whole is filled whole and stops being partial.
    cache.get_partial("img", 16 * C)
    cache.get("img", lambda dest: dest.write_bytes(b"w" * C))
    assert not cache.is_partial("img") and cache.path("img").read_bytes() == b"w" * C


def test_the_fuse_server_serves_a_stored_blob_as_a_mapping_reads_it(s3_server: S3Server, tmp_path: Path):
    """A real SeaweedFS and a real FUSE mount: an 8 MiB blob, a mapping reading two pages of it."""
    from aenv.repository.chunks import CHUNK_SIZE
    from aenv.repository.location import S3Location
    from aenv.repository.s3 import LAZY_MIN, S3Repository

    location = S3Location(
        bucket=s3_server.new_bucket(), prefix="p", endpoint=s3_server.endpoint, region=s3_server.region,
        access_key=s3_server.access_key, secret_key=s3_server.secret_key,
    )  # fmt: skip
    repository = S3Repository(location, tmp_path / "staging", node="node-a", part_size=5 << 20)
    size = LAZY_MIN
    image = tmp_path / "image"
    with open(image, "wb") as f:
        f.truncate(size)
        for i in (0, 3, 4, 20):
            f.seek(i * CHUNK_SIZE)
            f.write(os.urandom(CHUNK_SIZE))
    digest = repository.put_blob(image)
    key = digest.removeprefix("sha256:")
    mount = LazyMount.for_home(tmp_path / "home", tmp_path / "home" / "cache", location)
    index = mount.reader.chunk_index(digest)
    assert index is not None and index.data_chunks() == [0, 3, 4, 20]
    cache = BlobCache(tmp_path / "home" / "cache", 1 << 30, set)
    mount.ensure()
    try:
        cache.get_partial(key, index.size, "snap")
        mount.publish(key, index)
        expected = image.read_bytes()
        fd = os.open(mount.path(key), os.O_RDONLY)
        try:
            mapped = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
            page = 3 * CHUNK_SIZE + 4096
            assert mapped[page : page + 4096] == expected[page : page + 4096]
            mapped[page] = mapped[page] ^ 1  # private: the blob's copy never changes
            assert mapped[10 * CHUNK_SIZE] == 0  # a zero chunk: nothing fetched
            held = held_chunks(tmp_path / "home" / "cache" / key, index)
            assert 3 in held and 20 not in held  # only what the mapping touched (and readahead)
            mapped.close()
        finally:
            os.close(fd)
        assert mount.path(key).read_bytes() == expected
        # A restarted node attaches to the running server; one whose server died mounts anew.
        pid = server_pid(mount.state)
        again = LazyMount.for_home(tmp_path / "home", tmp_path / "home" / "cache", location)
        again.ensure()
        assert server_pid(again.state) == pid
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: server_pid(again.state) is None, timeout=10)
        again.ensure()
        assert server_pid(again.state) not in (None, pid)
        assert mount.path(key).read_bytes() == expected
        mount.reader.record_profile(digest, [3, 4])
        mount.reader.record_profile(digest, [0])  # the first record stays
        assert mount.reader.profile(digest) == [3, 4]
        # A chunk damaged in the store is an I/O error for its reader, not data.
        other = tmp_path / "other"
        other.write_bytes(os.urandom(size))
        bad = repository.put_blob(other)
        bad_key = bad.removeprefix("sha256:")
        cache.get_partial(bad_key, size, "snap")
        mount.publish(bad_key, mount.reader.chunk_index(bad))
        s3_server.client().put_object(
            Bucket=location.bucket, Key=mount.reader.key("blobs", bad), Body=b"\0" + other.read_bytes()[1:]
        )
        with open(mount.path(bad_key), "rb") as f, pytest.raises(OSError) as failed:
            f.read(4096)
        assert failed.value.errno == errno.EIO
    finally:
        mount.stop()
    assert not mount.alive()


def test_the_fuse_server_ends_and_unmounts_with_its_node_process(s3_server: S3Server, tmp_path: Path):
    """A node process killed with SIGKILL takes its FUSE server and mount along; a server left
    by another process is never attached to (issue 32)."""
    import subprocess
    import sys

    from aenv.repository.location import S3Location
    from aenv.runtime.lazyfs import _mounted

    location = S3Location(
        bucket=s3_server.new_bucket(), prefix="p", endpoint=s3_server.endpoint, region=s3_server.region,
        access_key=s3_server.access_key, secret_key=s3_server.secret_key,
    )  # fmt: skip
    home = tmp_path / "home"
    node = (
        "import sys, dataclasses; from pathlib import Path; from aenv.runtime.lazyfs import LazyMount;"
        "from aenv.repository.location import S3Location; home = Path(sys.argv[1]);"
        "LazyMount.for_home(home, home / 'cache', S3Location(bucket=sys.argv[2], prefix='p',"
        " endpoint=sys.argv[3], access_key=sys.argv[4], secret_key=sys.argv[5])).ensure();"
        "print('ready', flush=True); sys.stdin.read()"
    )
    args = [sys.executable, "-c", node, str(home), location.bucket, s3_server.endpoint,
            s3_server.access_key, s3_server.secret_key]  # fmt: skip
    process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    mount = LazyMount.for_home(home, home / "cache", location)
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        server = server_pid(mount.state)
        assert server is not None and _mounted(mount.mountpoint)
        assert not mount.alive()  # another process's server: never attached to
        process.kill()
        process.wait()
        wait_for(lambda: server_pid(mount.state) is None and not _mounted(mount.mountpoint), timeout=20)
    finally:
        process.kill()
        mount.stop()
