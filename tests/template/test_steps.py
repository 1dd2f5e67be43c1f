"""The build document and COPY archives: the SDK's own hashing and packing, checked on the host."""

from __future__ import annotations

import io
import os
import tarfile
import time
from pathlib import Path

import pytest
from e2b.template.utils import calculate_files_hash, tar_file_stream

from aenv.template.steps import (
    BuildStart,
    BuildState,
    Owner,
    Step,
    StepError,
    check_members,
    copy_archive,
    files_hash,
    first_forced,
    read_archive,
    split_name,
    step_key,
)
from aenv.template.uploads import UploadRefused, UploadStore


@pytest.fixture
def context(tmp_path: Path) -> Path:
    (tmp_path / "app" / "sub").mkdir(parents=True)
    (tmp_path / "app" / "main.py").write_text("print('hi')\n")
    (tmp_path / "app" / "sub" / "data.txt").write_text("data\n")
    (tmp_path / "app" / "link").symlink_to("main.py")
    os.link(tmp_path / "app" / "main.py", tmp_path / "app" / "hard.py")
    (tmp_path / "run.sh").write_text("#!/bin/sh\necho run\n")
    (tmp_path / "run.sh").chmod(0o755)
    return tmp_path


def sdk_upload(context: Path, src: str, dest: str) -> tuple[bytes, str]:
    """What the SDK uploads for ``COPY src dest`` and the filesHash it sends."""
    stream = tar_file_stream(src, str(context), [], False, True)
    data = stream.read()
    stream.close()
    return data, calculate_files_hash(src, dest, str(context), [], False, None)


@pytest.mark.parametrize("src", ["app", "run.sh", "app/sub/data.txt", "*.sh", "."])
def test_files_hash_matches_the_sdk(context: Path, src: str) -> None:
    data, expected = sdk_upload(context, src, "/dest/")
    archive = read_archive(data)
    check_members(archive)
    assert files_hash(archive, src, "/dest/") == expected
    assert files_hash(archive, src, "/other/") != expected


def members(plain: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(plain)) as archive:
        return {m.name: m for m in archive.getmembers()}


def test_copy_of_a_directory_puts_its_contents_at_dest(context: Path) -> None:
    archive = read_archive(sdk_upload(context, "app", "/srv/app")[0])
    out = members(copy_archive(archive, "/srv/app", dest_is_dir=False, owner=Owner(1000, 1000), mode=0o640))
    assert set(out) == {
        "srv/app/main.py",
        "srv/app/sub",
        "srv/app/sub/data.txt",
        "srv/app/link",
        "srv/app/hard.py",
    }
    assert out["srv/app/hard.py"].uid == 1000 and out["srv/app/hard.py"].mode == 0o640
    assert out["srv/app/link"].issym() and out["srv/app/link"].linkname == "main.py"
    # the SDK packs the second name of a hard-linked file as a link to the first (in sorted order)
    assert out["srv/app/main.py"].islnk() and out["srv/app/main.py"].linkname == "srv/app/hard.py"


@pytest.mark.parametrize(
    ("dest", "is_dir", "expected"),
    [("/opt/run", False, "opt/run"), ("/opt/", False, "opt/run.sh"), ("/opt", True, "opt/run.sh")],
)
def test_copy_of_a_file_follows_docker(context: Path, dest: str, is_dir: bool, expected: str) -> None:
    archive = read_archive(sdk_upload(context, "run.sh", dest)[0])
    out = members(copy_archive(archive, dest, dest_is_dir=is_dir, owner=Owner(), mode=None))
    assert list(out) == [expected]
    assert out[expected].mode == 0o755 and out[expected].uid == 0


def hostile(*entries: tarfile.TarInfo) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as archive:
        for entry in entries:
            archive.addfile(entry, io.BytesIO(b"x" * entry.size) if entry.isreg() else None)
    return out.getvalue()


def entry(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, linkname, 1 if kind == tarfile.REGTYPE else 0
    return info


@pytest.mark.parametrize(
    "bad",
    [
        entry("../escape"),
        entry("/etc/passwd"),
        entry("a/../../b"),
        entry("dev", tarfile.CHRTYPE),
        entry("fifo", tarfile.FIFOTYPE),
        entry("link", tarfile.LNKTYPE, "/etc/shadow"),
        entry("link", tarfile.LNKTYPE, "../../etc/shadow"),
    ],
)
def test_hostile_members_are_refused(bad: tarfile.TarInfo) -> None:
    with pytest.raises(StepError):
        check_members(read_archive(hostile(bad)))


def test_broken_and_oversized_archives_are_refused() -> None:
    with pytest.raises(StepError):
        read_archive(b"\x1f\x8bnot gzip at all")
    with pytest.raises(StepError):
        read_archive(hostile(entry("file"))[:700])


def test_step_keys_and_forcing() -> None:
    run = Step(type="RUN", args=["echo 1"])
    assert step_key("l1", run) == step_key("l1", Step(type="RUN", args=["echo 1"]))
    assert step_key("l1", run) != step_key("l2", run)
    assert step_key("l1", Step(type="COPY", args=["a", "b"], filesHash="0" * 64)) != step_key(
        "l1", Step(type="COPY", args=["a", "b"], filesHash="1" * 64)
    )
    start = BuildStart.model_validate(
        {
            "fromTemplate": "base",
            "steps": [{"type": "RUN", "args": ["a"]}, {"type": "RUN", "args": ["b"], "force": True}],
        }
    )
    assert first_forced(start) == 1
    assert first_forced(start.model_copy(update={"force": True})) == 0


def test_documents_are_validated() -> None:
    with pytest.raises(ValueError):
        BuildStart.model_validate({"steps": []})  # no source
    with pytest.raises(ValueError):
        BuildStart.model_validate({"fromTemplate": "base", "steps": [{"type": "COPY", "args": ["a", "b"]}]})
    with pytest.raises(ValueError):
        BuildStart.model_validate({"fromTemplate": "base", "steps": [{"type": "ENV", "args": ["A"]}]})
    assert split_name("team/my-env:v1") == ("my-env", "v1")
    with pytest.raises(StepError):
        split_name("Bad Name")
    assert BuildState(workdir="/home/user").path("app") == "/home/user/app"


async def test_presigned_uploads(tmp_path: Path) -> None:
    store = UploadStore(tmp_path, max_bytes=10)
    digest = "a" * 64
    expires, signature = store.sign("tpl", digest)
    store.authorize("tpl", digest, str(expires), signature)
    for template, files, when, sig in [
        ("other", digest, str(expires), signature),
        ("tpl", "b" * 64, str(expires), signature),
        ("tpl", digest, str(expires + 1), signature),
        ("tpl", digest, str(expires), "0" * 64),
    ]:
        with pytest.raises(UploadRefused):
            store.authorize(template, files, when, sig)
    old, old_signature = store.sign("tpl", digest, now=time.time() - 7200)
    with pytest.raises(UploadRefused, match="expired"):
        store.authorize("tpl", digest, str(old), old_signature)

    async def body(*chunks: bytes):
        for chunk in chunks:
            yield chunk

    with pytest.raises(UploadRefused):
        await store.receive(digest, body(b"12345", b"678901"), None)
    assert not list((tmp_path / "pending").iterdir()) and not list((tmp_path / "tmp").iterdir())
    await store.receive(digest, body(b"12345"), 5)
    assert store.archive(digest).read_bytes() == b"12345" and not store.present(digest)
    store.mark_present(digest)
    assert store.present(digest)
