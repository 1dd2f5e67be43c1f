"""envd driven by the official e2b SDK. Uses only the `sandbox` and `workdir` fixtures, so it can also run
against envd inside a real VM."""

from __future__ import annotations

import io
import time

import pytest
from e2b import (
    AuthenticationException,
    CommandExitException,
    FileNotFoundException,
    FileType,
    InvalidArgumentException,
    NotFoundException,
    SandboxException,
    TimeoutException,
)
from e2b.sandbox.commands.command_handle import PtySize
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType


def _wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# -- commands -------------------------------------------------------------------------------------------


def test_run_foreground(sandbox):
    r = sandbox.commands.run('echo "Hello, World!"; echo oops >&2')
    assert r.stdout == "Hello, World!\n"
    assert r.stderr == "oops\n"
    assert r.exit_code == 0


def test_exit_code(sandbox):
    with pytest.raises(CommandExitException) as exc:
        sandbox.commands.run("echo out; echo err >&2; exit 3")
    assert exc.value.exit_code == 3
    assert exc.value.stdout == "out\n"
    assert exc.value.stderr == "err\n"


def test_envs_and_cwd(sandbox, workdir):
    r = sandbox.commands.run(
        'echo "$FOO|$HOME|$USER"; pwd', envs={"FOO": "bar baz"}, cwd=workdir, user="root"
    )
    lines = r.stdout.splitlines()
    assert lines[0] == "bar baz|/root|root"
    assert lines[1] == workdir


def test_bad_cwd(sandbox, workdir):
    with pytest.raises(InvalidArgumentException):
        sandbox.commands.run("pwd", cwd=f"{workdir}/does/not/exist")


def test_user_root(sandbox):
    assert sandbox.commands.run("whoami", user="root").stdout == "root\n"
    assert sandbox.commands.run("id -u", user="nobody", cwd="/").stdout.strip() == "65534"


def test_timeout_kills_process(sandbox, workdir):
    marker = f"{workdir}/timeout-marker"
    with pytest.raises(TimeoutException):
        sandbox.commands.run(f"sleep 1.5; touch {marker}; sleep 30", timeout=1)
    time.sleep(1)
    assert not sandbox.files.exists(marker), "process must be killed when its timeout expires"


def test_on_stdout_streaming_order(sandbox):
    chunks: list[str] = []
    errs: list[str] = []
    r = sandbox.commands.run(
        "for i in 1 2 3 4 5; do echo $i; echo e$i >&2; sleep 0.05; done",
        on_stdout=chunks.append,
        on_stderr=errs.append,
    )
    assert "".join(chunks) == "1\n2\n3\n4\n5\n" == r.stdout
    assert "".join(errs) == "e1\ne2\ne3\ne4\ne5\n"
    assert len(chunks) >= 2, "output should be streamed, not buffered until exit"


def test_broken_utf8(sandbox):
    r = sandbox.commands.run(r"printf 'a\xe2\x82'; printf 'b'")
    assert r.stdout == "a\ufffdb"


def test_background_list_kill(sandbox):
    h = sandbox.commands.run("sleep 30", background=True)
    try:
        listed = {p.pid: p for p in sandbox.commands.list()}
        assert h.pid in listed
        assert listed[h.pid].cmd == "/bin/bash"
        assert listed[h.pid].args == ["-l", "-c", "sleep 30"]
        assert sandbox.commands.kill(h.pid) is True
        with pytest.raises(CommandExitException) as exc:
            h.wait()
        assert exc.value.exit_code == -1
    finally:
        sandbox.commands.kill(h.pid)
    assert _wait_until(lambda: h.pid not in {p.pid for p in sandbox.commands.list()})
    assert sandbox.commands.kill(999_999) is False


def test_handle_kill(sandbox):
    h = sandbox.commands.run("sleep 30", background=True)
    assert h.kill() is True
    with pytest.raises(CommandExitException):
        h.wait()


def test_stdin_send_and_close(sandbox):
    h = sandbox.commands.run("cat", background=True, stdin=True)
    h.send_stdin("abc\n")
    sandbox.commands.send_stdin(h.pid, "def\n")
    h.close_stdin()
    assert h.wait().stdout == "abc\ndef\n"


def test_stream_input(sandbox):
    h = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.stream_input(h.pid, ["a", b"b", "c\n"] + [f"{i}," for i in range(50)])
    sandbox.commands.close_stdin(h.pid)
    assert h.wait().stdout == "abc\n" + "".join(f"{i}," for i in range(50))


def test_stdin_disabled_by_default(sandbox):
    r = sandbox.commands.run("cat; echo done")
    assert r.stdout == "done\n"


def test_connect_and_disconnect(sandbox, workdir):
    h = sandbox.commands.run("sleep 1; echo later; exit 4", background=True)
    h.disconnect()  # the process must survive the client going away
    assert h.pid in {p.pid for p in sandbox.commands.list()}
    h2 = sandbox.commands.connect(h.pid)
    with pytest.raises(CommandExitException) as exc:
        h2.wait()
    assert exc.value.exit_code == 4
    assert "later" in exc.value.stdout
    with pytest.raises(NotFoundException):
        sandbox.commands.connect(999_999)


def test_pty(sandbox, workdir):
    h = sandbox.pty.create(PtySize(rows=24, cols=80), cwd=workdir, user="root", timeout=30)
    try:
        sandbox.pty.send_stdin(h.pid, b"stty size; echo hi-$((1+2))\n")
        out = b""
        resized = False
        for _, _, pty in h:
            if pty:
                out += pty
            if not resized and b"hi-3" in out:
                sandbox.pty.resize(h.pid, PtySize(rows=30, cols=100))
                sandbox.pty.send_stdin(h.pid, b"stty size; tty; exit 7\n")
                resized = True
        text = out.decode(errors="replace")
        assert "24 80" in text
        assert "30 100" in text
        assert "/dev/pts/" in text
    finally:
        sandbox.pty.kill(h.pid)


def test_pty_kill(sandbox):
    h = sandbox.pty.create(PtySize(rows=24, cols=80), timeout=30)
    assert sandbox.pty.kill(h.pid) is True
    with pytest.raises(CommandExitException):
        h.wait()


# -- files ------------------------------------------------------------------------------------------------


def test_write_read_formats(sandbox, workdir):
    path = f"{workdir}/a.txt"
    info = sandbox.files.write(path, "hello ✓")
    assert info.path == path and info.name == "a.txt" and info.type == FileType.FILE
    assert sandbox.files.read(path) == "hello ✓"
    assert bytes(sandbox.files.read(path, format="bytes")) == "hello ✓".encode()
    assert b"".join(sandbox.files.read(path, format="stream")) == "hello ✓".encode()
    assert sandbox.files.read(path, gzip=True) == "hello ✓"


def test_write_bytes_gzip_octet_stream(sandbox, workdir):
    blob = bytes(range(256)) * 1000
    sandbox.files.write(f"{workdir}/b.bin", blob)
    assert bytes(sandbox.files.read(f"{workdir}/b.bin", format="bytes")) == blob
    sandbox.files.write(f"{workdir}/g.bin", blob, gzip=True)
    assert bytes(sandbox.files.read(f"{workdir}/g.bin", format="bytes", gzip=True)) == blob
    sandbox.files.write(f"{workdir}/o.txt", "octet", use_octet_stream=True)
    assert sandbox.files.read(f"{workdir}/o.txt") == "octet"
    sandbox.files.write(f"{workdir}/it.txt", iter([b"it", b"er"]))
    assert sandbox.files.read(f"{workdir}/it.txt") == "iter"
    sandbox.files.write(f"{workdir}/io.txt", io.BytesIO(b"file object"))
    assert sandbox.files.read(f"{workdir}/io.txt") == "file object"


def test_write_files_with_parents(sandbox, workdir):
    infos = sandbox.files.write_files(
        [
            {"path": f"{workdir}/x/y/1.txt", "data": "1"},
            {"path": f"{workdir}/z/2.txt", "data": b"2"},
        ]
    )
    assert [i.path for i in infos] == [f"{workdir}/x/y/1.txt", f"{workdir}/z/2.txt"]
    assert sandbox.files.read(f"{workdir}/x/y/1.txt") == "1"
    assert sandbox.files.read(f"{workdir}/z/2.txt") == "2"


def test_write_overwrites_and_metadata(sandbox, workdir):
    path = f"{workdir}/m.txt"
    sandbox.files.write(path, "long content")
    info = sandbox.files.write(path, "short", metadata={"owner": "me", "Kind": "x"})
    assert info.metadata == {"owner": "me", "kind": "x"}
    assert sandbox.files.read(path) == "short"
    assert sandbox.files.get_info(path).metadata == {"owner": "me", "kind": "x"}


def test_list_depth(sandbox, workdir):
    sandbox.files.write(f"{workdir}/d/e/f.txt", "abc")
    sandbox.files.write(f"{workdir}/top.txt", "12345")
    one = sandbox.files.list(workdir)
    assert sorted((e.name, e.type) for e in one) == [("d", FileType.DIR), ("top.txt", FileType.FILE)]
    top = next(e for e in one if e.name == "top.txt")
    assert top.path == f"{workdir}/top.txt" and top.size == 5
    assert top.permissions.startswith("-rw") and top.mode & 0o600 == 0o600
    assert top.modified_time.year >= 2024
    two = {e.path for e in sandbox.files.list(workdir, depth=2)}
    assert f"{workdir}/d/e" in two and f"{workdir}/d/e/f.txt" not in two
    three = {e.path for e in sandbox.files.list(workdir, depth=3)}
    assert f"{workdir}/d/e/f.txt" in three


def test_exists_info_symlink(sandbox, workdir):
    sandbox.files.write(f"{workdir}/target.txt", "t")
    sandbox.commands.run(f"ln -s {workdir}/target.txt {workdir}/link", user="root")
    assert sandbox.files.exists(f"{workdir}/target.txt")
    assert not sandbox.files.exists(f"{workdir}/nope")
    info = sandbox.files.get_info(f"{workdir}/link")
    assert info.type == FileType.SYMLINK
    assert info.symlink_target == f"{workdir}/target.txt"
    plain = sandbox.files.get_info(f"{workdir}/target.txt")
    assert plain.type == FileType.FILE and plain.symlink_target is None and plain.size == 1


def test_make_dir_rename_remove(sandbox, workdir):
    assert sandbox.files.make_dir(f"{workdir}/new/nested") is True
    assert sandbox.files.make_dir(f"{workdir}/new/nested") is False
    sandbox.files.write(f"{workdir}/new/nested/f.txt", "x")
    moved = sandbox.files.rename(f"{workdir}/new", f"{workdir}/moved/deeper")
    assert moved.path == f"{workdir}/moved/deeper" and moved.type == FileType.DIR
    assert sandbox.files.read(f"{workdir}/moved/deeper/nested/f.txt") == "x"
    sandbox.files.remove(f"{workdir}/moved")
    assert not sandbox.files.exists(f"{workdir}/moved")
    sandbox.files.remove(f"{workdir}/moved")  # missing is fine
    with pytest.raises(FileNotFoundException):
        sandbox.files.rename(f"{workdir}/missing", f"{workdir}/other")


def test_missing_file(sandbox, workdir):
    with pytest.raises(FileNotFoundException):
        sandbox.files.read(f"{workdir}/missing.txt")
    with pytest.raises(FileNotFoundException):
        sandbox.files.get_info(f"{workdir}/missing.txt")
    with pytest.raises(FileNotFoundException):
        sandbox.files.list(f"{workdir}/missing-dir")


def test_watch_dir(sandbox, workdir):
    handle = sandbox.files.watch_dir(workdir, recursive=True, include_entry=True)
    try:
        sandbox.files.write(f"{workdir}/w.txt", "data")
        sandbox.files.make_dir(f"{workdir}/sub")
        time.sleep(0.2)
        sandbox.files.write(f"{workdir}/sub/inner.txt", "x")
        events = []
        _wait_until(
            lambda: events.extend(handle.get_new_events()) or any(e.name == "sub/inner.txt" for e in events)
        )
        kinds = {(e.name, e.type) for e in events}
        assert ("w.txt", FilesystemEventType.CREATE) in kinds
        assert ("w.txt", FilesystemEventType.WRITE) in kinds
        assert ("sub", FilesystemEventType.CREATE) in kinds
        assert ("sub/inner.txt", FilesystemEventType.CREATE) in kinds
        assert handle.get_new_events() == []  # drained
        sandbox.files.remove(f"{workdir}/w.txt")
        assert _wait_until(
            lambda: (
                events.extend(handle.get_new_events())
                or ("w.txt", FilesystemEventType.REMOVE) in {(e.name, e.type) for e in events}
            )
        )
    finally:
        handle.stop()


def test_permission_denied_for_other_user(sandbox, workdir):
    secret = f"{workdir}/private"
    sandbox.files.make_dir(secret, user="root")
    sandbox.files.write(f"{secret}/s.txt", "secret", user="root")
    sandbox.commands.run(f"chmod 711 {workdir}; chmod 700 {secret}", user="root")
    with pytest.raises(CommandExitException) as exc:
        sandbox.commands.run(f"cat {secret}/s.txt", user="nobody", cwd="/")
    assert "Permission denied" in exc.value.stderr
    with pytest.raises(SandboxException):
        sandbox.files.read(f"{secret}/s.txt", user="nobody")
    with pytest.raises(SandboxException):
        sandbox.files.write(f"{secret}/t.txt", "x", user="nobody")
    with pytest.raises(SandboxException):
        sandbox.files.list(secret, user="nobody")
    assert sandbox.files.read(f"{secret}/s.txt", user="root") == "secret"


def test_file_ownership_follows_user(sandbox):
    # A world-traversable directory: the per-test workdir's parents may be private to root.
    shared = sandbox.commands.run(
        "d=$(mktemp -d /tmp/envd-own.XXXXXX) && chmod 777 $d && echo $d", user="root"
    ).stdout.strip()
    try:
        info = sandbox.files.write(f"{shared}/owned/n.txt", "n", user="nobody")
        assert sandbox.files.get_info(info.path).owner == "nobody"
        assert sandbox.files.get_info(f"{shared}/owned").owner == "nobody"
        assert sandbox.files.make_dir(f"{shared}/mk", user="nobody") is True
        assert sandbox.files.get_info(f"{shared}/mk").owner == "nobody"
    finally:
        sandbox.files.remove(shared, user="root")


def test_unknown_user(sandbox):
    with pytest.raises(AuthenticationException):
        sandbox.commands.run("true", user="no-such-user-xyz")


# -- bad input: a clear 4xx the SDK maps to its exception, never a 500 ------------------------------------


def test_bad_command_input_is_invalid_argument(sandbox):
    with pytest.raises(InvalidArgumentException, match="NUL"):
        sandbox.commands.run("echo a\x00b")
    with pytest.raises(InvalidArgumentException, match="variable name"):
        sandbox.commands.run("true", envs={"A=B": "x"})
    with pytest.raises(InvalidArgumentException, match="NUL"):
        sandbox.commands.run("true", envs={"A": "x\x00y"})
    with pytest.raises(InvalidArgumentException, match="NUL"):
        sandbox.commands.run("true", cwd="/tmp\x00")
    with pytest.raises(AuthenticationException, match="invalid username"):
        sandbox.commands.run("true", user="root\x00")
    assert sandbox.commands.run("echo still fine").stdout == "still fine\n"


def test_bad_paths_are_invalid_argument(sandbox, workdir):
    long_path = "/" + "a" * 5000
    component = f"{workdir}/{'b' * 300}"
    with pytest.raises(InvalidArgumentException, match="longer than"):
        sandbox.files.read(long_path)
    with pytest.raises(InvalidArgumentException, match="longer than"):
        sandbox.files.write(long_path, "x")
    with pytest.raises(InvalidArgumentException):
        sandbox.files.write(component, "x")
    with pytest.raises(InvalidArgumentException, match="NUL"):
        sandbox.files.write(f"{workdir}/a\x00b", "x")
    for call in (sandbox.files.get_info, sandbox.files.list, sandbox.files.make_dir, sandbox.files.remove):
        with pytest.raises(InvalidArgumentException):
            call(long_path)
        with pytest.raises(InvalidArgumentException):
            call(f"{workdir}/nul\x00")
    sandbox.files.write(f"{workdir}/x", "x")
    with pytest.raises(InvalidArgumentException):
        sandbox.files.rename(f"{workdir}/x", component)
    with pytest.raises(InvalidArgumentException):
        sandbox.files.watch_dir(f"{workdir}\x00")
    with pytest.raises(AuthenticationException):
        sandbox.files.read("/etc/hostname", user="root\x00")
    with pytest.raises(AuthenticationException):
        sandbox.files.list("/", user="root\x00")


# -- output: streamed with backpressure -----------------------------------------------------------------


def test_large_output_is_streamed_whole(sandbox):
    received = 0

    def count(chunk: str) -> None:
        nonlocal received
        received += len(chunk)

    r = sandbox.commands.run("yes | head -c $((32 << 20))", retain_output=False, on_stdout=count, timeout=0)
    assert r.exit_code == 0 and received == 32 << 20


def test_unread_output_blocks_only_its_process(sandbox):
    """A client that does not read a chatty command's stream leaves the output in the pipe."""
    h = sandbox.commands.run("yes", background=True, timeout=0)
    try:
        assert sandbox.commands.run("echo alive").stdout == "alive\n"
        assert h.pid in {p.pid for p in sandbox.commands.list()}
    finally:
        h.kill()


def test_output_of_a_disconnected_command_is_dropped(sandbox, workdir):
    """Without any reader envd drains and drops the output, so a background command runs to its end."""
    command = f"head -c $((16 << 20)) /dev/zero; touch {workdir}/done"
    h = sandbox.commands.run(command, background=True, timeout=0)
    h.disconnect()
    assert _wait_until(lambda: sandbox.files.exists(f"{workdir}/done"), timeout=60)


# -- uploads: metadata, ownership, watch events as E2B's envd ---------------------------------------------


def test_write_without_metadata_clears_metadata(sandbox, workdir):
    path = f"{workdir}/meta.txt"
    assert sandbox.files.write(path, "1", metadata={"a": "1", "b": "2"}).metadata == {"a": "1", "b": "2"}
    assert sandbox.files.write(path, "2", metadata={"a": "3"}).metadata == {"a": "3"}
    assert sandbox.files.get_info(path).metadata == {"a": "3"}
    info = sandbox.files.write(path, "3")
    assert not info.metadata
    assert not sandbox.files.get_info(path).metadata


def test_upload_owner_and_mode(sandbox):
    shared = sandbox.commands.run(
        "d=$(mktemp -d /tmp/envd-up.XXXXXX) && chmod 777 $d && echo $d", user="root"
    )
    d = shared.stdout.strip()
    try:
        sandbox.files.write(f"{d}/new.txt", "n", user="nobody")
        stat = sandbox.commands.run(f"stat -c '%U:%G %a' {d}/new.txt", user="root").stdout.strip()
        group = sandbox.commands.run("id -gn nobody", user="root").stdout.strip()
        assert stat == f"nobody:{group} 644"
        # Overwriting a file keeps its mode and, as in E2B's envd, gives it to the writer.
        sandbox.commands.run(f"echo old > {d}/shared.txt && chmod 666 {d}/shared.txt", user="root")
        sandbox.files.write(f"{d}/shared.txt", "new", user="nobody")
        stat = sandbox.commands.run(f"stat -c '%U:%G %a' {d}/shared.txt", user="root").stdout.strip()
        assert stat == f"nobody:{group} 666"
        assert sandbox.files.read(f"{d}/shared.txt") == "new"
    finally:
        sandbox.files.remove(d, user="root")


def test_upload_watch_events(sandbox, workdir):
    handle = sandbox.files.watch_dir(workdir)
    try:
        sandbox.files.write(f"{workdir}/up.txt", "data")
        events: list = []
        assert _wait_until(
            lambda: (
                events.extend(handle.get_new_events())
                or {FilesystemEventType.CREATE, FilesystemEventType.WRITE, FilesystemEventType.CHMOD}
                <= {e.type for e in events if e.name == "up.txt"}
            )
        )
    finally:
        handle.stop()
