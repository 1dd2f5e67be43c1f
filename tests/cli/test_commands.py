"""Every non-interactive command against a real node with real VMs, output parsed as piped JSON."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
from pathlib import Path

import pytest

from aenv.devnode import DevNode

from .conftest import API_KEY, CLI

pytestmark = pytest.mark.vm


def test_auth_verifies_and_stores_credentials_0600(cli: CLI, server: DevNode, tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "AENV_URL": "", "AENV_API_KEY": ""}
    rejected = cli.run("auth", input=f"{server.url}\nwrong-key\n".encode(), env=env)
    assert rejected.code == 1
    assert "authentication failed (HTTP 401)" in rejected.stderr
    assert not (tmp_path / ".config/aenv/credentials").exists()

    cli.ok("auth", input=f"{server.url}\n{API_KEY}\n".encode(), env=env)
    path = tmp_path / ".config/aenv/credentials"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert f'url = "{server.url}"' in path.read_text()
    listed = cli.ok("ls", "-o", "json", env=env).json()
    assert isinstance(listed, list)
    # The environment overrides the file.
    overridden = cli.run("ls", env=env | {"AENV_API_KEY": "nope"})
    assert overridden.code == 1 and "HTTP 401" in overridden.stderr


def test_unauthenticated_and_unreachable_are_one_sentence(cli: CLI, tmp_path: Path) -> None:
    missing = cli.run("ls", env={"HOME": str(tmp_path), "AENV_API_KEY": ""})
    assert missing.code == 1 and "run `aenv auth`" in missing.stderr
    down = cli.run("ls", env={"AENV_URL": "http://127.0.0.1:9"})
    assert down.code == 1 and "cannot reach the aenv server at http://127.0.0.1:9" in down.stderr
    assert len(down.stderr.strip().splitlines()) == 1


def test_templates(cli: CLI) -> None:
    templates = cli.ok("template", "list").json()
    base = next(t for t in templates if "base" in t["names"])
    assert cli.ok("templates", "get", "base").json()["templateID"] == base["templateID"]
    assert "TEMPLATE ID" in cli.ok("template", "ls", "--output", "table").stdout
    missing = cli.run("template", "get", "no-such-template")
    assert missing.code == 1 and "not found (HTTP 404)" in missing.stderr


def test_start_list_exec_timeout_delete(cli: CLI) -> None:
    sandbox_id = cli.ok(
        "start", "base", "-d", "--timeout", "600", "--env", "GREETING=hello there", "--metadata", "owner=t1"
    ).stdout.strip()
    try:
        listed = cli.ok("list", "--metadata", "owner=t1").json()
        assert [s["sandboxID"] for s in listed] == [sandbox_id]
        assert listed[0]["state"] == "running" and listed[0]["metadata"] == {"owner": "t1"}
        assert cli.ok("ls", "--metadata", "owner=nobody").json() == []

        assert cli.ok("exec", sandbox_id, "--", "sh", "-c", 'echo "$GREETING"').stdout == "hello there\n"
        split = cli.run("exec", sandbox_id, "echo out; echo err >&2; exit 7")
        assert (split.code, split.stdout, split.stderr) == (7, "out\n", "err\n")
        payload = bytes(range(256)) * 1000
        piped = cli.run("exec", sandbox_id, "--", "sha256sum", input=payload)
        assert piped.code == 0 and piped.stdout.split()[0] == hashlib.sha256(payload).hexdigest()
        binary = cli.run("exec", sandbox_id, "--", "cat", input=payload)
        assert binary.raw == payload
        assert cli.run("exec", sandbox_id).code != 0  # no command: usage error

        cli.ok("timeout", sandbox_id, "900")
        info = cli.ok("info", sandbox_id).json()
        assert info["sandboxID"] == sandbox_id and "envdAccessToken" not in info
    finally:
        cli.ok("delete", sandbox_id)
    gone = cli.run("rm", sandbox_id)
    assert gone.code == 1 and "HTTP 404" in gone.stderr


def test_resources_come_from_the_snapshot(cli: CLI) -> None:
    base = cli.ok("template", "get", "base").json()["builds"][0]
    wrong = cli.run("start", "base", "-d", "--cpus", str(base["cpuCount"] + 7))
    assert wrong.code == 1 and "sandboxes restore the snapshot's machine" in wrong.stderr
    sandbox_id = cli.ok(
        "start", "base", "-d", "--cpu", str(base["cpuCount"]), "--memory", str(base["memoryMB"])
    ).stdout.strip()
    cli.ok("rm", sandbox_id)


def test_pause_resume_keeps_state(cli: CLI, sandbox: str) -> None:
    cli.ok("exec", sandbox, "echo kept > ~/state.txt")
    assert cli.ok("pause", sandbox).json() == [{"sandboxID": sandbox, "state": "paused"}]
    assert sandbox in [s["sandboxID"] for s in cli.ok("ls", "--state", "paused").json()]
    assert sandbox not in [s["sandboxID"] for s in cli.ok("ls", "--state", "running").json()]
    refused = cli.run("exec", sandbox, "true")
    assert refused.code == 1 and f"aenv resume {sandbox}" in refused.stderr
    assert cli.ok("resume", sandbox).json()[0]["sandboxID"] == sandbox
    assert cli.ok("exec", sandbox, "cat ~/state.txt").stdout == "kept\n"


def test_snapshot_and_fork(cli: CLI, sandbox: str) -> None:
    cli.ok("exec", sandbox, "echo from-parent > ~/mark")
    snapshot = cli.ok("snapshot", "create", sandbox, "--name", "cli-snap").json()
    listed = cli.ok("snap", "ls", "--sandbox-id", sandbox).json()
    assert snapshot["snapshotID"] in [s["snapshotID"] for s in listed]
    restored = cli.ok("start", "cli-snap", "-d").stdout.strip()
    children = cli.ok("fork", sandbox, "--count", "2").json()
    try:
        assert len(children) == 2
        for sandbox_id in [restored, *(c["sandboxID"] for c in children)]:
            assert cli.ok("exec", sandbox_id, "cat ~/mark").stdout == "from-parent\n"
    finally:
        cli.ok("rm", restored, *(c["sandboxID"] for c in children))
    not_a_snapshot = cli.run("snapshot", "delete", "base")
    assert not_a_snapshot.code == 1
    cli.ok("snapshot", "delete", "cli-snap")
    assert snapshot["snapshotID"] not in [s["snapshotID"] for s in cli.ok("snapshot", "list").json()]


def test_upload_download_trees(cli: CLI, sandbox: str, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "sub" / "empty").mkdir(parents=True)
    (tree / "a.txt").write_text("alpha\n")
    (tree / "sub" / "blob.bin").write_bytes(os.urandom(3 << 20))
    (tree / "link").symlink_to("a.txt")
    up = cli.ok("upload", sandbox, str(tree), "/tmp/dest/").json()
    assert up == {"path": "/tmp/dest/tree", "files": 2, "bytes": 6 + (3 << 20)}
    assert cli.ok("exec", sandbox, "cat /tmp/dest/tree/a.txt").stdout == "alpha\n"
    assert cli.ok("exec", sandbox, "test -d /tmp/dest/tree/sub/empty").code == 0
    cli.ok("upload", sandbox, str(tree / "a.txt"), "renamed.txt")
    assert cli.ok("exec", sandbox, "cat ~/renamed.txt").stdout == "alpha\n"

    out = tmp_path / "out"
    out.mkdir()
    down = cli.ok("download", sandbox, "/tmp/dest/tree", str(out)).json()
    assert down["files"] == 2
    assert (out / "tree" / "sub" / "blob.bin").read_bytes() == (tree / "sub" / "blob.bin").read_bytes()
    assert (out / "tree" / "sub" / "empty").is_dir()
    conflict = cli.run("download", sandbox, "/tmp/dest/tree", str(out))
    assert conflict.code == 1 and "--force" in conflict.stderr
    cli.ok("download", sandbox, "/tmp/dest/tree", str(out), "--force")
    cli.ok("download", sandbox, "renamed.txt", cwd=tmp_path)
    assert (tmp_path / "renamed.txt").read_text() == "alpha\n"
    missing = cli.run("download", sandbox, "/no/such/file")
    assert missing.code == 1 and "does not exist" in missing.stderr


def test_logs(cli: CLI, sandbox: str) -> None:
    # A restored guest may have printed nothing yet: a kernel alert reaches the serial console.
    cli.ok("exec", "-u", "root", sandbox, "--", "sh", "-c", "echo '<1>aenv: a line for the logs' > /dev/kmsg")
    logs = cli.ok("logs", sandbox).json()
    assert any("a line for the logs" in entry["line"] for entry in logs)
    assert len(cli.ok("logs", sandbox, "--tail", "2").json()) == min(2, len(logs))


def test_completion_scripts(cli: CLI, sandbox: str, tmp_path: Path) -> None:
    script = tmp_path / "aenv.bash"
    script.write_text(cli.ok("completion", "bash").stdout)
    subprocess.run(["bash", "-n", str(script)], check=True)
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "aenv").write_text(f'#!/bin/sh\nexec {" ".join(cli.command())} "$@"\n')
    (shim / "aenv").chmod(0o755)

    def complete(line: str) -> list[str]:
        words = line.split(" ")
        program = (
            f"source {script}; COMP_WORDS=({' '.join(repr(w) for w in words)}); "
            f"COMP_CWORD={len(words) - 1}; _aenv; printf '%s\\n' \"${{COMPREPLY[@]}}\""
        )
        env = cli.env | {"PATH": f"{shim}:{cli.env['PATH']}"}
        return subprocess.run(["bash", "-c", program], capture_output=True, text=True, env=env).stdout.split()

    assert {"start", "connect", "cn", "snapshot"} <= set(complete("aenv "))
    assert set(complete("aenv snap ")) == {"create", "list", "ls", "delete", "rm", "--help"}
    assert complete("aenv ls --output ") == ["table", "json"]
    assert sandbox in complete("aenv pause ")
    assert "base" in complete("aenv start ")
    assert "bashcompinit" in cli.ok("completion", "zsh").stdout
