"""envd's own build work (users, WORKDIR, COPY), on image trees in a temporary directory.

The same code runs in the build VM (``tests/e2e/test_template_build.py`` builds from Debian,
busybox-static and a shell-less image); here its routes are served by aiohttp in-process.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from aenv.agent.envd import accounts, build_api

BUSYBOX_PASSWD = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/home:/bin/false\n"


@pytest.fixture
def image(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A busybox-like image root: passwd and group, no shadow, no skel."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/passwd").write_text(BUSYBOX_PASSWD)
    (tmp_path / "etc/group").write_text("root:x:0:\nnogroup:x:65534:")  # no final newline
    monkeypatch.setattr(accounts, "ROOT", str(tmp_path))
    return tmp_path


def test_a_user_is_created_with_its_group_and_home(image: Path) -> None:
    account = accounts.ensure_user("user")
    assert account == accounts.Account("user", 1000, 1000, "/home/user")
    assert (image / "etc/passwd").read_text() == BUSYBOX_PASSWD + "user:x:1000:1000::/home/user:/bin/sh\n"
    assert (image / "etc/group").read_text() == "root:x:0:\nnogroup:x:65534:\nuser:x:1000:\n"
    home = (image / "home/user").stat()
    assert (home.st_uid, home.st_gid, home.st_mode & 0o7777) == (1000, 1000, 0o755)
    assert not (image / "etc/shadow").exists()
    assert accounts.ensure_user("user") == account  # once only
    assert (image / "etc/passwd").read_text().count("\nuser:") == 1


def test_debian_like_images_get_shadow_entries_skel_and_the_next_ids(image: Path) -> None:
    (image / "etc/passwd").write_text(BUSYBOX_PASSWD + "first:x:1000:1000::/home/first:/bin/sh\n")
    (image / "etc/group").write_text("root:x:0:\nfirst:x:1000:\nweb:x:1001:\n")
    (image / "etc/shadow").write_text("root:*:19000:0:99999:7:::\n")
    (image / "etc/gshadow").write_text("root:*::\n")
    (image / "etc/skel").mkdir()
    (image / "etc/skel/.profile").write_text("# profile\n")
    account = accounts.ensure_user("builder")
    assert (account.uid, account.gid) == (1001, 1002)  # uid after the highest; gid 1001 is taken
    assert (image / "etc/shadow").read_text().splitlines()[-1].startswith("builder:!:")
    assert (image / "etc/gshadow").read_text().splitlines()[-1] == "builder:!::"
    profile = (image / "home/builder/.profile").stat()
    assert (profile.st_uid, profile.st_gid) == (1001, 1002)
    assert accounts.owner("builder:web") == (1001, 1001)
    assert accounts.owner("first") == (1000, 1000) and accounts.owner("7:8") == (7, 8)


def test_images_without_passwd_or_with_bad_names(image: Path) -> None:
    (image / "etc/passwd").unlink()
    assert accounts.owner("root") == (0, 0)
    assert accounts.ensure_user("user").uid == 1000
    assert (image / "etc/passwd").read_text().startswith("root:x:0:0:")
    for bad in ("Bad Name", "../x", "a:b", ""):
        with pytest.raises(accounts.AccountError):
            accounts.ensure_user(bad)
    with pytest.raises(accounts.AccountError, match="no user 'ghost'"):
        accounts.owner("ghost")
    with pytest.raises(accounts.AccountError, match="no group 'ghosts'"):
        accounts.owner("user:ghosts")


def test_sudo_is_granted_only_where_the_image_has_it(image: Path) -> None:
    assert not accounts.grant_sudo("user")
    (image / "etc/sudoers.d").mkdir()
    assert not accounts.grant_sudo("user")
    (image / "usr/bin").mkdir(parents=True)
    (image / "usr/bin/sudo").write_bytes(b"")
    assert accounts.grant_sudo("user")
    drop_in = image / "etc/sudoers.d/user"
    assert drop_in.read_text() == "user ALL=(ALL:ALL) NOPASSWD: ALL\n"
    assert drop_in.stat().st_mode & 0o7777 == 0o440


@contextlib.asynccontextmanager
async def envd() -> AsyncIterator[TestClient]:
    app = web.Application()
    app.add_routes(build_api.routes())
    async with TestClient(TestServer(app)) as client:
        yield client


def archive(*files: tuple[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        folder = tarfile.TarInfo("app")
        folder.type, folder.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(folder)
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(out.getvalue())


async def test_routes_create_users_and_directories_and_unpack_a_streamed_copy(image: Path) -> None:
    async with envd() as client:
        await routes_work(client, image)


async def routes_work(envd: TestClient, image: Path) -> None:
    answer = await envd.post("/aenv/build/user", json={"name": "user", "sudo": True})
    assert await answer.json() == {"uid": 1000, "gid": 1000, "home": "/home/user", "sudo": False}
    work = image / "srv/work"
    answer = await envd.post("/aenv/build/workdir", json={"path": str(work), "user": "user"})
    assert answer.status == 200 and work.stat().st_uid == 1000

    big = os.urandom(3 << 20)  # several reads of the body
    plan = {"roots": [["app", True]], "dest": str(image / "opt/app"), "chown": "user", "mode": 0o640}
    body = json.dumps(plan).encode() + b"\n" + archive(("app/big.bin", big), ("app/small.txt", b"hi"))
    answer = await envd.post("/aenv/build/copy", data=body)
    assert answer.status == 200, await answer.text()
    copied = (image / "opt/app/big.bin").stat()
    assert (copied.st_uid, copied.st_gid, copied.st_mode & 0o7777) == (1000, 1000, 0o640)
    assert (image / "opt/app/big.bin").read_bytes() == big

    refusals = [
        (json.dumps({**plan, "chown": "ghost"}).encode() + b"\n", "no user 'ghost'"),
        (b"not json\n" + archive(), "invalid COPY plan"),
        (json.dumps(plan).encode() + b"\nnot a tar archive", "not a valid tar archive"),
        (json.dumps({**plan, "dest": "relative"}).encode() + b"\n" + archive(), "not absolute"),
    ]
    for body, message in refusals:
        answer = await envd.post("/aenv/build/copy", data=body)
        assert answer.status == 400 and message in (await answer.json())["message"], body[:80]
    assert (await (await envd.post("/aenv/build/image", json={})).json()) == {
        "shell": os.access("/bin/sh", os.X_OK)
    }
    assert (await envd.post("/aenv/build/sync", json={})).status == 204
