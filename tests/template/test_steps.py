"""The build document and COPY archives: the SDK's own hashing and packing, checked on the host."""

from __future__ import annotations

import io
import os
import tarfile
import time
from pathlib import Path

import pytest
from e2b.template.utils import calculate_files_hash, tar_file_stream

from aenv.agent.envd import copying
from aenv.template.steps import (
    BuildStart,
    BuildState,
    Step,
    StepError,
    first_forced,
    split_name,
    step_key,
    verified_roots,
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


def sdk_upload(context: Path, src: str, dest: str) -> tuple[Path, Step]:
    """The archive the SDK uploads for ``COPY src dest`` (as the node stores it) and the step."""
    stream = tar_file_stream(src, str(context), [], False, True)
    upload = context.parent / f"upload-{abs(hash((src, dest)))}.tar.gz"
    upload.write_bytes(stream.read())
    stream.close()
    files_hash = calculate_files_hash(src, dest, str(context), [], False, None)
    return upload, Step(type="COPY", args=[src, dest], filesHash=files_hash)


@pytest.mark.parametrize("src", ["app", "run.sh", "app/sub/data.txt", "*.sh", "."])
def test_files_hash_matches_the_sdk(context: Path, src: str) -> None:
    upload, step = sdk_upload(context, src, "/dest/")
    assert verified_roots(upload, step)
    with pytest.raises(StepError, match="do not match their hash"):
        verified_roots(upload, step.model_copy(update={"args": [src, "/other/"]}))


def unpack(upload: Path, step: Step, dest: str, **owner: int) -> None:
    """What envd writes for the step, the destination being under a test directory."""
    plan = copying.CopyPlan(verified_roots(upload, step), dest, **owner)
    with upload.open("rb") as source:
        copying.unpack(source, plan)


def test_copy_of_a_directory_puts_its_contents_at_dest(
    context: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("guest")
    upload, step = sdk_upload(context, "app", "/srv/app")
    unpack(upload, step, f"{root}/srv/app", uid=1000, gid=1000, mode=0o640)
    app = root / "srv/app"
    assert {p.name for p in app.iterdir()} == {"main.py", "sub", "link", "hard.py"}
    hard = (app / "hard.py").stat()
    assert (hard.st_uid, hard.st_gid, hard.st_mode & 0o7777) == (1000, 1000, 0o640)
    assert os.readlink(app / "link") == "main.py" and os.lstat(app / "link").st_uid == 1000
    # the SDK packs the second name of a hard-linked file as a link to the first (in sorted order)
    assert (app / "main.py").stat().st_ino == hard.st_ino
    assert (app / "sub/data.txt").read_text() == "data\n"


@pytest.mark.parametrize(
    ("dest", "is_dir", "expected"),
    [("opt/run", False, "opt/run"), ("opt/", False, "opt/run.sh"), ("opt", True, "opt/run.sh")],
)
def test_copy_of_a_file_follows_docker(
    context: Path, tmp_path_factory: pytest.TempPathFactory, dest: str, is_dir: bool, expected: str
) -> None:
    root = tmp_path_factory.mktemp("guest")
    if is_dir:
        (root / "opt").mkdir()
    upload, step = sdk_upload(context, "run.sh", f"/{dest}")
    unpack(upload, step, f"{root}/{dest}")
    written = (root / expected).stat()
    assert written.st_mode & 0o7777 == 0o755 and written.st_uid == 0
    assert (root / expected).read_text() == "#!/bin/sh\necho run\n"


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


HOSTILE = [
    entry("../escape"),
    entry("/etc/passwd"),
    entry("a/../../b"),
    entry("dev", tarfile.CHRTYPE),
    entry("fifo", tarfile.FIFOTYPE),
    entry("link", tarfile.LNKTYPE, "/etc/shadow"),
    entry("link", tarfile.LNKTYPE, "../../etc/shadow"),
]


@pytest.mark.parametrize("bad", HOSTILE)
def test_hostile_members_are_refused_by_the_node_and_by_envd(bad: tarfile.TarInfo, tmp_path: Path) -> None:
    upload = tmp_path / "upload.tar"
    upload.write_bytes(hostile(bad))
    with pytest.raises(StepError, match=r"unsafe|not a file|escaping"):
        verified_roots(upload, Step(type="COPY", args=["x", "/y"], filesHash="0" * 64))
    plan = copying.CopyPlan([("x", True)], str(tmp_path / "dest"))
    with pytest.raises(copying.CopyError), upload.open("rb") as source:
        copying.unpack(source, plan)


def test_broken_archives_are_refused(tmp_path: Path) -> None:
    step = Step(type="COPY", args=["x", "/y"], filesHash="0" * 64)
    for data in (b"\x1f\x8bnot gzip at all", hostile(entry("file"))[:700]):
        (tmp_path / "upload").write_bytes(data)
        with pytest.raises(StepError, match="not a valid tar archive"):
            verified_roots(tmp_path / "upload", step)


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
