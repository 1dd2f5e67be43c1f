"""The build cache: keys follow inputs, builds are atomic and happen once."""

from pathlib import Path

import pytest

from aenv.guest import cache, tools


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AENV_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_inputs_key_changes_only_with_inputs() -> None:
    base = cache.inputs_key(a="1", b=["x", "y"])
    assert cache.inputs_key(a="1", b=["x", "y"]) == base
    assert cache.inputs_key(b=["x", "y"], a="1") == base  # order of keywords does not matter
    assert cache.inputs_key(a="2", b=["x", "y"]) != base
    assert cache.inputs_key(a="1", b=["x", "z"]) != base


def test_tree_digest_sees_content_and_names(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("x = 1\n")
    first = cache.tree_digest(tmp_path / "pkg")
    (tmp_path / "pkg" / "__pycache__").mkdir()
    (tmp_path / "pkg" / "__pycache__" / "m.pyc").write_bytes(b"junk")
    assert cache.tree_digest(tmp_path / "pkg") == first  # bytecode caches are not inputs
    (tmp_path / "pkg" / "m.py").write_text("x = 2\n")
    assert cache.tree_digest(tmp_path / "pkg") != first
    assert cache.tree_digest(tmp_path / "missing") == cache.tree_digest(tmp_path / "also-missing")


def test_cached_build_runs_once(cache_root: Path) -> None:
    calls = []

    def build(out: Path) -> None:
        calls.append(out)
        (out / "thing").write_text("done")

    first = cache.cached_build("kind", "k1", build, "thing")
    second = cache.cached_build("kind", "k1", build, "thing")
    assert first == second == cache_root / "kind" / "k1"
    assert len(calls) == 1
    assert (first / "thing").read_text() == "done"


def test_interrupted_build_leaves_nothing(cache_root: Path) -> None:
    def build(out: Path) -> None:
        (out / "thing").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cache.cached_build("kind", "k2", build, "thing")
    assert not (cache_root / "kind" / "k2").exists()
    assert not [p for p in (cache_root / "kind").iterdir() if p.name.endswith(".tmp")]


def test_envd_change_changes_only_tools_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aenv.guest import rootfs, runtime

    envd = tmp_path / "envd"
    envd.mkdir()
    (envd / "__init__.py").write_text("")
    monkeypatch.setattr(tools, "ENVD_SOURCE", envd)
    runtime_before = runtime.runtime_key()
    tools_before, rootfs_before = tools.tools_key(runtime_before), rootfs.rootfs_key()
    assert tools.tools_key(runtime_before) == tools_before
    (envd / "server.py").write_text("PORT = 49983\n")
    assert tools.tools_key(runtime_before) != tools_before
    assert rootfs.rootfs_key() == rootfs_before
    assert runtime.runtime_key() == runtime_before, "envd is not part of the runtime: it is not rebuilt"
