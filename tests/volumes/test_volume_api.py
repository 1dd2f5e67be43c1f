"""The volume API through the official SDK's `Volume`, without VMs: the node's real routes and
middlewares over a `VolumeStore` in a temporary home, served from a thread of their own so the
synchronous SDK can call them. (Mounts into sandboxes: tests/e2e/test_volumes.py.)"""

from __future__ import annotations

import asyncio
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from aenv.api import schemas
from aenv.api.runner import APIRunner
from aenv.api.server import NodeAPI
from aenv.config import Settings
from aenv.volumes.store import GUEST_IDS, IdRange, VolumeStore

KEY = "e2b_" + "1a" * 20
MOUNTED = "in-use"  # the volume name the fake orchestrator says a sandbox mounts


class NoNode:
    def __getattr__(self, name: str):
        raise AssertionError(f"the volume API called the node service ({name})")


IDS = IdRange(1_900_000_000, GUEST_IDS)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VolumeStore]:
    store = VolumeStore(
        tmp_path_factory.mktemp("home") / "volumes", IDS, 64, lambda name: ["isbx"] if name == MOUNTED else []
    )
    yield store
    store.close()


@pytest.fixture(scope="module")
def node_url(store: VolumeStore) -> Iterator[str]:
    api = NodeAPI(NoNode(), domain="", limits=schemas.limits(Settings()), volumes=store)  # type: ignore[arg-type]
    loop = asyncio.new_event_loop()
    runner = APIRunner(api.app(KEY), access_log=None, handle_signals=False)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()


@pytest.fixture(autouse=True)
def sdk_env(node_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("E2B_")]:
        monkeypatch.delenv(name)
    for name in ("E2B_API_URL", "E2B_VOLUME_API_URL"):
        monkeypatch.setenv(name, node_url)
    monkeypatch.setenv("E2B_API_KEY", KEY)


def test_volume_lifecycle_and_content() -> None:
    from e2b import Volume, VolumeException
    from e2b.exceptions import NotFoundException

    volume = Volume.create("data")
    assert volume.volume_id.startswith("vol") and volume.token
    with pytest.raises(VolumeException, match="already exists"):
        Volume.create("data")
    assert [(v.volume_id, v.name) for v in Volume.list()] == [(volume.volume_id, "data")]
    assert Volume.connect(volume.volume_id).token == volume.token

    made = volume.make_dir("/a/b", force=True, mode=0o750)
    assert (made.path, made.type.value, made.mode) == ("/a/b", "directory", 0o750)
    written = volume.write_file("/a/b/c.txt", "hello", mode=0o600, uid=1234, gid=1234)
    assert (written.size, written.mode, written.uid, written.gid) == (5, 0o600, 1234, 1234)
    assert volume.read_file("/a/b/c.txt") == "hello"
    assert volume.read_file("a/b/c.txt", format="bytes") == b"hello"
    assert b"".join(volume.read_file("/a/b/c.txt", format="stream")) == b"hello"
    assert [e.path for e in volume.list("/", depth=3)] == ["/a", "/a/b", "/a/b/c.txt"]
    assert [e.name for e in volume.list("/a")] == ["b"]
    assert volume.update_metadata("/a/b/c.txt", mode=0o644).mode == 0o644
    assert volume.exists("/a/b/c.txt") and not volume.exists("/nope")
    with pytest.raises(VolumeException, match="already exists"):
        volume.make_dir("/a/b")
    with pytest.raises(VolumeException, match="is a directory"):
        volume.write_file("/a/b", "x")
    with pytest.raises(NotFoundException):
        volume.write_file("/missing/parent.txt", "x")  # without force, parents must exist
    with pytest.raises(NotFoundException):
        volume.read_file("/nope")
    volume.remove("/a")
    assert volume.list("/") == []
    assert Volume.destroy(volume.volume_id) is True
    assert Volume.destroy(volume.volume_id) is False  # 404
    assert Volume.list() == []


def test_content_is_confined_to_the_volume(store: VolumeStore, tmp_path: Path) -> None:
    """A symlink a guest made cannot lead the content API out of the volume."""
    from e2b import Volume, VolumeException

    volume = Volume.create("confined")
    try:
        secret = tmp_path / "host-secret"
        secret.write_text("host only")
        root = store.data(store.get(volume.volume_id))
        (root / "escape").symlink_to(tmp_path)
        (root / "file-link").symlink_to(secret)
        with pytest.raises(VolumeException, match="outside the volume"):
            volume.read_file("/escape/host-secret")
        with pytest.raises(VolumeException):
            volume.read_file("/file-link")  # the final symlink is not followed
        with pytest.raises(VolumeException, match="outside the volume"):
            volume.write_file("/escape/new.txt", "x")
        assert volume.get_info("/file-link").target == str(secret)
        (root / "inside").mkdir()
        (root / "alias").symlink_to("inside")  # a symlink that stays in the volume is followed
        volume.write_file("/alias/through-link.txt", "kept")
        assert (root / "inside" / "through-link.txt").read_text() == "kept"
        with pytest.raises(VolumeException, match=r"'\.\.'"):
            volume.list("/../..")
        assert secret.read_text() == "host only" and not (tmp_path / "new.txt").exists()
    finally:
        Volume.destroy(volume.volume_id)


def test_tokens_and_keys(node_url: str) -> None:
    """The content API takes the volume's token and nothing else; the control plane the API key."""
    from e2b import Volume

    volume = Volume.create("guarded")
    other = Volume.create("other")
    try:
        url = f"{node_url}/volumecontent/{volume.volume_id}/dir"
        for headers in ({}, {"Authorization": f"Bearer {other.token}"}, {"X-API-Key": KEY}):
            answer = httpx.get(url, params={"path": "/"}, headers=headers)
            assert answer.status_code == 403 and answer.json()["code"] == 403
        answer = httpx.get(
            url, params={"path": "/", "depth": "x"}, headers={"Authorization": f"Bearer {volume.token}"}
        )
        assert answer.status_code == 400 and "depth" in answer.json()["message"]
        assert httpx.get(f"{node_url}/volumes").status_code == 401
        assert (
            httpx.post(f"{node_url}/volumes", json={"name": "../x"}, headers={"X-API-Key": KEY}).status_code
            == 400
        )
    finally:
        Volume.destroy(volume.volume_id)
        Volume.destroy(other.volume_id)


def test_a_mounted_volume_is_not_deleted() -> None:
    from e2b import Volume, VolumeException

    volume = Volume.create(MOUNTED)
    with pytest.raises(VolumeException, match="isbx"):
        Volume.destroy(volume.volume_id)
    assert Volume.get_info(volume.volume_id).name == MOUNTED


def test_volume_mounts_are_validated() -> None:
    def mounts(value: object) -> None:
        schemas.NewSandbox.model_validate({"templateID": "base", "volumeMounts": value})

    mounts([{"name": "data", "path": "/mnt/data/"}, {"name": "x", "path": "/home/user/.cache/a.b-c_d"}])
    for bad in (
        [{"name": "data", "path": "relative"}],
        [{"name": "data", "path": "/"}],
        [{"name": "data", "path": "/mnt/../etc"}],
        [{"name": "bad name", "path": "/mnt"}],
        [{"name": "data", "path": "/mnt/./x"}],
        [{"name": "data", "path": "/mnt/\udc00"}],
        [{"name": "data", "path": "/mnt/x y"}],
        [{"name": "data", "path": "/mnt/..x"}],
        [{"name": "data"}],
    ):
        with pytest.raises(ValueError):
            mounts(bad)


def test_owners_are_guest_ids_on_the_host_range(store: VolumeStore) -> None:
    """What the content API shows and sets are guests' ids; on the host they are the mapped range."""
    from e2b import Volume, VolumeException

    volume = Volume.create("owners")
    try:
        root = store.data(store.get(volume.volume_id))
        written = volume.write_file("/d/f.txt", "x", force=True, uid=1000, gid=1000)
        assert (written.uid, written.gid) == (1000, 1000)
        assert (root / "d" / "f.txt").stat().st_uid == IDS.base + 1000
        assert (root / "d").stat().st_uid == IDS.base  # made for it: the guests' root
        assert volume.get_info("/").uid == 0
        with pytest.raises(VolumeException, match="out of range"):
            volume.update_metadata("/d/f.txt", uid=GUEST_IDS)
        os.mkfifo(root / "fifo")  # never opened (it would block), nor would a device node be
        os.mknod(root / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        for special in ("/fifo", "/null"):
            with pytest.raises(VolumeException, match="not a regular file"):
                volume.read_file(special)
    finally:
        Volume.destroy(volume.volume_id)


def test_deep_trees_are_deleted(store: VolumeStore, node_url: str) -> None:
    """1,200 levels (shutil.rmtree's recursion failed at ~1,000): a path, then a whole volume."""
    from e2b import Volume

    volume = Volume.create("deep")
    deep = "/".join(["d"] * 1200)
    volume.make_dir(f"/top/{deep}", force=True)
    root = store.data(store.get(volume.volume_id))
    (root / "top" / deep / "f.txt").write_text("bottom")
    (root / "top" / "d" / "link").symlink_to("/etc")  # removed, never followed
    volume.remove("/top")
    assert volume.list("/") == []
    volume.make_dir(f"/again/{deep}", force=True)
    assert Volume.destroy(volume.volume_id) is True
    assert not (store.root / volume.volume_id).exists()
    assert Path("/etc/hostname").exists()


def test_a_volume_never_grows_past_its_size(store: VolumeStore, node_url: str) -> None:
    """The size set at create bounds the content API's writes (507, the file left as it was)."""
    from e2b import Volume

    headers = {"X-API-Key": KEY}
    answer = httpx.post(f"{node_url}/volumes", json={"name": "small", "sizeMiB": 16}, headers=headers)
    assert answer.status_code == 201 and answer.json()["sizeMiB"] == 16
    volume = Volume.connect(answer.json()["volumeID"])
    try:
        volume.write_file("/kept.bin", b"k" * 2**20)
        url = f"{node_url}/volumecontent/{volume.volume_id}/file"
        auth = {"Authorization": f"Bearer {volume.token}"}
        for path in ("/big.bin", "/kept.bin"):
            answer = httpx.put(url, params={"path": path}, content=b"x" * (20 * 2**20), headers=auth)
            assert answer.status_code == 507 and "full" in answer.json()["message"]
        assert volume.read_file("/kept.bin", format="bytes") == b"k" * 2**20
        assert [e.name for e in volume.list("/")] == ["kept.bin"]  # no upload left behind
        for size in (8, 10**6, "16"):
            answer = httpx.post(f"{node_url}/volumes", json={"name": "no", "sizeMiB": size}, headers=headers)
            assert answer.status_code == 400, size
    finally:
        Volume.destroy(volume.volume_id)
