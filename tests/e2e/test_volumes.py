"""E2B volumes through the official SDK on a real node: the content API, mounts shared by two
sandboxes, and mounts that keep working after pause/resume and in a fork's child."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .conftest import NodeServer, Sandboxes, run_in


@pytest.fixture
def volume(node: NodeServer, sandboxes: Sandboxes, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    from e2b import Volume

    monkeypatch.setenv("E2B_VOLUME_API_URL", node.url)  # the content API is the node's too
    created = Volume.create(f"shared-{sandboxes.tag}")
    yield created
    sandboxes.close()
    sandboxes.ids.clear()
    Volume.destroy(created.volume_id)


def test_volume_shared_by_sandboxes_across_pause_resume_and_fork(volume, sandboxes: Sandboxes) -> None:
    from e2b import Sandbox, Volume, VolumeException

    volume.write_file("/seed/hello.txt", "from the content API", force=True)
    assert [e.path for e in volume.list("/", depth=2)] == ["/seed", "/seed/hello.txt"]
    assert Volume.get_info(volume.volume_id).token == volume.token

    with pytest.raises(Exception, match="no-such-volume"):  # a 400, never a sandbox without it
        sandboxes.create(volume_mounts={"/mnt/data": "no-such-volume"})

    a = sandboxes.create(volume_mounts={"/mnt/shared": volume})
    b = sandboxes.create(volume_mounts={"/mnt/shared": volume.name})
    assert a.files.read("/mnt/shared/seed/hello.txt") == "from the content API"
    a.files.write("/mnt/shared/from-a.txt", "written in a")
    assert b.files.read("/mnt/shared/from-a.txt") == "written in a"
    assert volume.read_file("/from-a.txt") == "written in a"
    assert volume.get_info("/from-a.txt").uid == int(run_in(a, "id -u"))  # the guest user owns it

    with pytest.raises(VolumeException, match="mounted"):  # 409 while sandboxes mount it
        Volume.destroy(volume.volume_id)

    a.pause()
    b.files.write("/mnt/shared/while-a-paused.txt", "from b")
    a = Sandbox.connect(a.sandbox_id)
    assert a.files.read("/mnt/shared/while-a-paused.txt") == "from b"
    a.files.write("/mnt/shared/after-resume.txt", "a again")
    assert b.files.read("/mnt/shared/after-resume.txt") == "a again"

    (child,) = a.fork(count=1)
    sandboxes.track(child.sandbox_id)
    child.files.write("/mnt/shared/from-child.txt", "child")
    assert b.files.read("/mnt/shared/from-child.txt") == "child"
    assert a.files.read("/mnt/shared/from-child.txt") == "child"  # the fork's source kept its mount
    assert Sandbox.get_info(child.sandbox_id).volume_mounts == [{"name": volume.name, "path": "/mnt/shared"}]
