"""Layers are applied with Docker semantics and hostile layers never touch a file outside scratch.

Each hostile case aims at a real sentinel directory next to the scratch tree (by absolute path,
by ``..``, through symlinks planted in the same or an earlier layer) and the test compares a
full listing of everything outside the scratch tree before and after: contents, modes, link
counts and times must be unchanged, and no file may appear.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from aenv.template import ImageStore, LayerRefused, unpack
from aenv.template.unpack import apply_layer
from tests.template.oci import (
    device,
    directory,
    fifo,
    file,
    hardlink,
    layer,
    lying_header,
    single_image,
    symlink,
)


@pytest.fixture
def sentinel(tmp_path: Path) -> Path:
    """A directory outside the scratch tree that every hostile layer tries to reach."""
    path = tmp_path / "sentinel"
    path.mkdir()
    (path / "secret").write_text("untouched")
    (path / "sub").mkdir()
    return path


def listing(top: Path, skip: Path) -> dict[str, tuple]:
    """Everything under ``top`` except ``skip``: type, mode, size, link count, times, content."""
    result = {}
    for directory_, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if Path(directory_, d) != skip]
        for name in (*dirs, *files):
            path = Path(directory_, name)
            st = path.lstat()
            content = hashlib.sha256(path.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else None
            result[str(path)] = (st.st_mode, st.st_size, st.st_nlink, st.st_mtime_ns, st.st_uid, content)
    return result


def apply(tmp_path: Path, *layers: bytes) -> Path:
    """Unpack an image made of ``layers`` into ``tmp_path/scratch/rootfs`` and return that root."""
    store = ImageStore(tmp_path / "store")
    image = store.import_oci_layout(single_image(tmp_path / "layout", list(layers)))
    scratch = tmp_path / "scratch"
    scratch.mkdir(mode=0o700)
    unpack(image, scratch / "rootfs")
    return scratch / "rootfs"


def hostile(tmp_path: Path, sentinel: Path, *layers: bytes, refused: str | None = None) -> Path:
    """Apply hostile layers; assert nothing outside scratch changed and the layer was (not) refused."""
    (tmp_path / "scratch").mkdir(mode=0o700)
    store = ImageStore(tmp_path / "store")
    image = store.import_oci_layout(single_image(tmp_path / "layout", list(layers)))
    before = listing(sentinel.parent, tmp_path / "scratch")
    root = tmp_path / "scratch" / "rootfs"
    if refused:
        with pytest.raises(LayerRefused, match=refused):
            unpack(image, root)
    else:
        unpack(image, root)
    after = listing(sentinel.parent, tmp_path / "scratch")
    assert after == before
    assert (sentinel / "secret").read_text() == "untouched"
    return root


def test_files_directories_links_and_metadata(tmp_path: Path) -> None:
    root = apply(
        tmp_path,
        layer(
            directory("etc", 0o755),
            file("etc/hostname", b"img\n", 0o644),
            file("usr/bin/tool", b"#!/bin/sh\n", 0o4755, uid=0),
            directory("home/user", 0o700, uid=1000, gid=1000),
            file("home/user/.profile", b"x", 0o600, uid=1000, gid=1000),
            symlink("lib", "usr/lib"),
            file("usr/lib/libc.so", b"elf"),
            hardlink("usr/lib/libc.so.6", "usr/lib/libc.so"),
            file(
                "usr/bin/ping",
                b"elf",
                0o755,
                **{"SCHILY.xattr.user.note": "hi", "SCHILY.xattr.trusted.x": "y"},
            ),
            fifo("run/initctl"),
            device("dev/null"),
            directory(".", 0o755),
        ),
    )
    assert (root / "etc/hostname").read_bytes() == b"img\n"
    assert stat.S_IMODE((root / "usr/bin/tool").stat().st_mode) == 0o4755
    home = (root / "home/user").stat()
    assert (home.st_uid, home.st_gid, stat.S_IMODE(home.st_mode)) == (1000, 1000, 0o700)
    assert (root / "home/user/.profile").stat().st_uid == 1000
    assert os.readlink(root / "lib") == "usr/lib"
    assert (root / "usr/lib/libc.so.6").stat().st_ino == (root / "usr/lib/libc.so").stat().st_ino
    assert os.getxattr(root / "usr/bin/ping", "user.note") == b"hi"
    assert "trusted.x" not in os.listxattr(root / "usr/bin/ping")
    assert stat.S_ISFIFO((root / "run/initctl").lstat().st_mode)
    assert not (root / "dev/null").exists()  # device nodes are skipped
    assert (root / "etc").stat().st_mtime == 1_700_000_000  # directory times set after their contents
    assert stat.S_IMODE(root.stat().st_mode) == 0o755


def test_later_layers_write_through_symlinks_of_earlier_ones_inside_the_root(tmp_path: Path) -> None:
    """usrmerge: /lib -> usr/lib in one layer, lib/x in the next lands in usr/lib/x."""
    root = apply(
        tmp_path, layer(symlink("lib", "/usr/lib"), directory("usr/lib")), layer(file("lib/x", b"1"))
    )
    assert (root / "usr/lib/x").read_bytes() == b"1"
    assert os.readlink(root / "lib") == "/usr/lib"


def test_whiteouts_and_opaque_directories(tmp_path: Path) -> None:
    root = apply(
        tmp_path,
        layer(
            file("a/x", b"x"),
            file("a/y", b"y"),
            file("b/z", b"z"),
            file("c/old", b"old"),
            directory("c/olddir"),
            file("c/olddir/f"),
            symlink("d", "/a"),
        ),
        layer(
            file("c/new", b"new"),  # before the opaque marker: still kept
            file("a/.wh.x"),
            file(".wh.b"),
            file("c/.wh..wh..opq"),
            file(".wh.d"),  # removes the symlink, not what it points to
            file("a/.wh..wh.plnk"),  # aufs bookkeeping: ignored
            file(".wh.missing"),
        ),
    )
    assert sorted(os.listdir(root / "a")) == ["y"]
    assert not (root / "b").exists()
    assert sorted(os.listdir(root / "c")) == ["new"]
    assert not (root / "d").is_symlink()
    assert not any(name.startswith(".wh.") for _, dirs, files in os.walk(root) for name in dirs + files)


def test_duplicate_entries_last_wins(tmp_path: Path) -> None:
    root = apply(
        tmp_path,
        layer(
            file("f", b"first"),
            file("f", b"second", 0o600),
            directory("d"),
            file("d/inner"),
            file("d", b"now a file"),  # a file replaces the whole directory
            symlink("s", "f"),
            file("s", b"replaced link"),  # replaces the symlink, does not write through it
        ),
    )
    assert (root / "f").read_bytes() == b"second"
    assert stat.S_IMODE((root / "f").stat().st_mode) == 0o600
    assert (root / "d").read_bytes() == b"now a file"
    assert (root / "s").read_bytes() == b"replaced link" and not (root / "s").is_symlink()
    assert (root / "f").read_bytes() == b"second"


def test_dotdot_entry_is_refused(tmp_path: Path, sentinel: Path) -> None:
    hostile(tmp_path, sentinel, layer(file("../../sentinel/pwned", b"x")), refused="contains '..'")
    hostile_dir = tmp_path / "again"
    hostile_dir.mkdir()
    hostile(hostile_dir, sentinel, layer(file("ok/../../x")), refused="contains '..'")


def test_absolute_names_stay_inside(tmp_path: Path, sentinel: Path) -> None:
    root = hostile(tmp_path, sentinel, layer(file(f"{sentinel}/secret", b"pwned"), file("/etc/abs", b"1")))
    assert (root / str(sentinel).lstrip("/") / "secret").read_bytes() == b"pwned"
    assert (root / "etc/abs").read_bytes() == b"1"


def test_absolute_symlink_from_an_earlier_layer_is_followed_inside_the_root(
    tmp_path: Path, sentinel: Path
) -> None:
    root = hostile(
        tmp_path,
        sentinel,
        layer(symlink("escape", str(sentinel))),
        layer(
            file("escape/secret", b"pwned"), file("escape/sub/new", b"pwned"), directory("escape/sub", 0o777)
        ),
    )
    inside = root / str(sentinel).lstrip("/")
    assert (inside / "secret").read_bytes() == b"pwned"
    assert (inside / "sub/new").read_bytes() == b"pwned"


def test_relative_escaping_symlink_in_the_same_layer(tmp_path: Path, sentinel: Path) -> None:
    up = "../" * 30
    root = hostile(
        tmp_path,
        sentinel,
        layer(
            symlink("up", up),
            file(f"up/{str(sentinel).lstrip('/')}/pwned", b"x"),
            symlink("s2", f"{up}{sentinel}"),
        ),
        layer(file("s2/secret", b"x"), fifo("s2/fifo")),
    )
    assert (root / str(sentinel).lstrip("/") / "pwned").exists()
    assert (root / str(sentinel).lstrip("/") / "secret").read_bytes() == b"x"


def test_hardlinks_cannot_reach_outside(tmp_path: Path, sentinel: Path) -> None:
    hostile(tmp_path, sentinel, layer(hardlink("h", f"{sentinel}/secret")), refused="does not exist")
    second = tmp_path / "second"
    second.mkdir()
    hostile(
        second,
        sentinel,
        layer(symlink("s", str(sentinel))),
        layer(hardlink("h", "s/secret")),
        refused="does not exist",
    )
    third = tmp_path / "third"
    third.mkdir()
    hostile(third, sentinel, layer(hardlink("h", "../sentinel/secret")), refused="contains '..'")
    assert (sentinel / "secret").stat().st_nlink == 1


def test_file_replacing_a_planted_symlink_or_hardlink_does_not_write_through(
    tmp_path: Path, sentinel: Path
) -> None:
    root = hostile(
        tmp_path,
        sentinel,
        layer(symlink("etc", str(sentinel)), file("a", b"a"), hardlink("b", "a")),
        layer(file("etc", b"a file now"), file("b", b"new b")),
    )
    assert (root / "etc").read_bytes() == b"a file now"
    assert (root / "a").read_bytes() == b"a"  # the hardlink's other name keeps the old content


def test_symlink_loops_and_files_in_the_path_are_refused(tmp_path: Path, sentinel: Path) -> None:
    hostile(tmp_path, sentinel, layer(symlink("loop", "loop"), file("loop/x")), refused="symbolic links")
    other = tmp_path / "other"
    other.mkdir()
    hostile(other, sentinel, layer(file("f"), file("f/x")), refused="not a directory")


def test_device_nodes_are_skipped_and_setuid_stays_private(tmp_path: Path, sentinel: Path) -> None:
    root = hostile(
        tmp_path,
        sentinel,
        layer(
            device("sda", tarfile.BLKTYPE, 8, 0),
            device("mem", tarfile.CHRTYPE, 1, 1),
            file("su", b"x", 0o6755),
        ),
    )
    assert sorted(os.listdir(root)) == ["su"]
    assert stat.S_IMODE((root / "su").stat().st_mode) == 0o6755
    assert stat.S_IMODE(root.parent.stat().st_mode) & 0o077 == 0  # no other host user reaches it


def test_unpack_refuses_a_shared_parent(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    image = store.import_oci_layout(single_image(tmp_path / "layout", [layer(file("x"))]))
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(ValueError, match="other users"):
        unpack(image, shared / "rootfs")


def test_huge_and_truncated_files_are_refused(tmp_path: Path, sentinel: Path) -> None:
    # exabytes claimed by a tiny layer: refused at the end of the stream, not read for hours
    hostile(tmp_path, sentinel, lying_header("big", 1 << 62, b"x" * 100), refused="ends inside an entry")
    small = tmp_path / "small"
    small.mkdir()
    hostile(small, sentinel, lying_header("cut", 1 << 20, b"x" * 1000), refused="ends inside an entry")


def test_size_budget_is_checked_before_writing(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    layers = [layer(file("a", b"x" * 600)), layer(file("b", b"y" * 600))]
    image = store.import_oci_layout(single_image(tmp_path / "layout", layers))
    with pytest.raises(LayerRefused, match="allowed size"):
        unpack(image, tmp_path / "rootfs", max_bytes=1000)
    assert (tmp_path / "rootfs/a").exists() and not (tmp_path / "rootfs/b").exists()


def test_truncated_stream_and_wrong_diff_id_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    tar = layer(file("a", os.urandom(50_000)), file("b", b"b"))
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(gzip.compress(tar)[:-200])
    with pytest.raises(LayerRefused, match="not a valid tar stream"):
        apply_layer(root, cut)
    whole = tmp_path / "whole.tar"
    whole.write_bytes(tar)
    with pytest.raises(LayerRefused, match="image config says"):
        apply_layer(root, whole, diff_id="sha256:" + "0" * 64)


def test_zstd_layers(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    tar = tmp_path / "layer.tar"
    tar.write_bytes(layer(file("z", b"zstd content")))
    subprocess.run(["zstd", "-q", str(tar), "-o", str(tmp_path / "layer.tar.zst")], check=True)
    apply_layer(
        root, tmp_path / "layer.tar.zst", diff_id="sha256:" + hashlib.sha256(tar.read_bytes()).hexdigest()
    )
    assert (root / "z").read_bytes() == b"zstd content"


def test_whiteouts_through_planted_symlinks_stay_inside(tmp_path: Path, sentinel: Path) -> None:
    root = hostile(
        tmp_path,
        sentinel,
        layer(symlink("escape", str(sentinel)), file(f"{sentinel}/inside", b"1")),
        layer(file("escape/.wh.secret"), file("escape/sub/.wh..wh..opq"), file("escape/.wh.inside")),
    )
    assert not (root / str(sentinel).lstrip("/") / "inside").exists()
