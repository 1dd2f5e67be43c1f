"""The official `e2b` Python SDK (sync API), unchanged, against a real node."""

from __future__ import annotations

import io
import re
import time

import httpx
import pytest
from e2b import (
    CommandExitException,
    FileType,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)
from e2b.exceptions import SandboxException

from .conftest import NodeServer, Sandboxes, run_in, wait_until

pytestmark = pytest.mark.vm

SANDBOX_ID = re.compile(r"^[a-z0-9]+$")


def proxied_get(node: NodeServer, host: str, path: str = "/") -> httpx.Response:
    """A request to `https://<host>`, sent to the node itself (`*.localhost` may not resolve here)."""
    return httpx.get(node.url + path, headers={"Host": host}, timeout=10)


# -- create ------------------------------------------------------------------------------------


def test_create_default(sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create()
    assert SANDBOX_ID.match(sandbox.sandbox_id)
    assert sandbox.is_running()
    info = sandbox.get_info()
    assert info.state == SandboxState.RUNNING
    assert info.name == "base"
    assert info.end_at > info.started_at
    assert info.envd_version
    assert run_in(sandbox, "whoami") == "user\n"


def test_create_by_template_id_and_alias(sandboxes: Sandboxes) -> None:
    by_alias = sandboxes.create("base")
    template_id = by_alias.get_info().template_id
    assert template_id and template_id != "base"
    by_id = sandboxes.create(template_id)
    assert by_id.get_info().template_id == template_id
    assert run_in(by_id, "echo ok") == "ok\n"


def test_create_unknown_template(sandboxes: Sandboxes) -> None:
    with pytest.raises(SandboxException, match="404"):  # the SDK maps a create's 404 to this
        sandboxes.create("no-such-template")


def test_create_metadata_envs_timeout(sandboxes: Sandboxes) -> None:
    metadata = {"k": "v", "odd": "a b&c=d%e"}
    sandbox = sandboxes.create(metadata=metadata, envs={"FOO": "bar", "BAZ": "q u x"}, timeout=120)
    assert run_in(sandbox, 'echo "$FOO|$BAZ"') == "bar|q u x\n"
    info = sandbox.get_info()
    for key, value in metadata.items():
        assert info.metadata[key] == value
    lifetime = (info.end_at - info.started_at).total_seconds()
    assert 110 <= lifetime <= 130, lifetime


@pytest.mark.parametrize("secure", [True, False])
def test_create_secure(sandboxes: Sandboxes, node: NodeServer, secure: bool) -> None:
    # SDK 2.63 creates through /v2/sandboxes, where every sandbox is secured (`secure` is ignored).
    sandbox = sandboxes.create(secure=secure)
    assert run_in(sandbox, "echo hi") == "hi\n"
    headers = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "49983"}
    response = httpx.get(node.url + "/files", params={"path": "/etc/hostname"}, headers=headers, timeout=10)
    assert response.status_code == 401, response.text


def test_create_unsecured_v1(sandboxes: Sandboxes, node: NodeServer) -> None:
    """Older SDKs create through /sandboxes, where `secure: false` means envd takes no token."""
    body = {"templateID": "base", "secure": False, "timeout": 120, "metadata": {"e2e": sandboxes.tag}}
    created = httpx.post(node.url + "/sandboxes", json=body, headers={"X-API-Key": node.key}, timeout=60)
    assert created.status_code == 201, created.text
    sandbox_id = created.json()["sandboxID"]
    sandboxes.track(sandbox_id)
    assert not created.json().get("envdAccessToken")
    headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983"}
    response = httpx.get(node.url + "/files", params={"path": "/etc/hostname"}, headers=headers, timeout=10)
    assert response.status_code == 200, response.text


# -- commands ----------------------------------------------------------------------------------


def test_commands_foreground(sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create()
    result = sandbox.commands.run('echo "Hello, World!"; echo oops >&2')
    assert (result.stdout, result.stderr, result.exit_code) == ("Hello, World!\n", "oops\n", 0)
    with pytest.raises(CommandExitException) as failed:
        sandbox.commands.run("echo bad >&2; exit 3")
    assert failed.value.exit_code == 3
    assert "bad" in failed.value.stderr
    chunks: list[str] = []
    sandbox.commands.run("for i in 1 2 3; do echo $i; sleep 0.1; done", on_stdout=chunks.append)
    assert "".join(chunks) == "1\n2\n3\n"


def test_commands_envs_cwd_user(sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create(envs={"FROM_CREATE": "c"})
    assert sandbox.commands.run('echo "$X $FROM_CREATE"', envs={"X": "1"}).stdout == "1 c\n"
    assert sandbox.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sandbox.commands.run("whoami", user="root").stdout == "root\n"
    assert sandbox.commands.run("whoami; echo $HOME").stdout == "user\n/home/user\n"


def test_commands_timeout(sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create()
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sandbox.commands.run("sleep 30", timeout=2)
    assert time.monotonic() - started < 20


def test_commands_background_and_stdin(sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create()
    sleeper = sandbox.commands.run("sleep 120", background=True)
    assert sleeper.pid in [p.pid for p in sandbox.commands.list()]
    assert sandbox.commands.kill(sleeper.pid)
    with pytest.raises(CommandExitException):
        sleeper.wait()
    assert not sandbox.commands.kill(999999)

    cat = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.send_stdin(cat.pid, "abc\n")
    sandbox.commands.send_stdin(cat.pid, "def\n")
    sandbox.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "abc\ndef\n"

    ticker = sandbox.commands.run("for i in 1 2 3 4; do echo t$i; sleep 0.5; done", background=True)
    ticker.disconnect()
    again = sandbox.commands.connect(ticker.pid)
    assert "t4" in again.wait().stdout


def test_pty(sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create()
    output = bytearray()
    terminal = sandbox.pty.create(PtySize(rows=24, cols=80), timeout=60)
    sandbox.pty.resize(terminal.pid, PtySize(rows=30, cols=100))
    sandbox.pty.send_stdin(terminal.pid, b"stty size; echo pty-$((6*7)); exit\n")
    terminal.wait(on_pty=output.extend)
    text = output.decode(errors="replace")
    assert "pty-42" in text
    assert "30 100" in text
    other = sandbox.pty.create(PtySize(rows=24, cols=80))
    assert sandbox.pty.kill(other.pid)


# -- files -------------------------------------------------------------------------------------


def test_files(sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create()
    files = sandbox.files
    info = files.write("a.txt", "hello")
    assert (info.path, info.type) == ("/home/user/a.txt", FileType.FILE)
    assert files.read("a.txt") == "hello"
    assert files.read("/home/user/a.txt", format="bytes") == bytearray(b"hello")
    assert b"".join(files.read("a.txt", format="stream")) == b"hello"

    blob = bytes(range(256)) * 4096  # 1 MiB, every byte value
    files.write("/tmp/blob.bin", io.BytesIO(blob))
    assert bytes(files.read("/tmp/blob.bin", format="bytes")) == blob
    files.write("/tmp/gz.txt", "zipped " * 1000, gzip=True)
    assert files.read("/tmp/gz.txt", gzip=True) == "zipped " * 1000
    files.write("/tmp/octet.txt", "octet", use_octet_stream=True)
    assert files.read("/tmp/octet.txt") == "octet"

    written = files.write_files([{"path": "/tmp/multi/x", "data": "1"}, {"path": "rel/y", "data": b"2"}])
    assert sorted(w.path for w in written) == ["/home/user/rel/y", "/tmp/multi/x"]
    assert run_in(sandbox, "cat /tmp/multi/x ~/rel/y") == "12"

    with pytest.raises(NotFoundException):
        files.read("missing.txt")
    assert files.exists("a.txt")
    assert not files.exists("missing.txt")
    assert files.make_dir("d/e")
    assert not files.make_dir("d/e")
    files.write("d/e/f.txt", "f")
    listed = {entry.path: entry for entry in files.list("d", depth=2)}
    assert listed["/home/user/d/e"].type == FileType.DIR
    assert listed["/home/user/d/e/f.txt"].size == 1

    run_in(sandbox, "ln -s /home/user/a.txt /home/user/link")
    link = files.get_info("link")
    assert link.symlink_target == "/home/user/a.txt"

    moved = files.rename("a.txt", "b.txt")
    assert moved.path == "/home/user/b.txt"
    assert not files.exists("a.txt")
    files.remove("d")
    assert not files.exists("d")
    files.remove("d")  # removing what is gone is not an error

    files.write("meta.txt", "m", metadata={"owner": "me"})
    assert files.get_info("meta.txt").metadata == {"owner": "me"}


def test_files_watch_and_presigned_urls(sandboxes: Sandboxes, node: NodeServer) -> None:
    sandbox = sandboxes.create()
    sandbox.files.make_dir("/tmp/watched")
    handle = sandbox.files.watch_dir("/tmp/watched")
    try:
        sandbox.files.write("/tmp/watched/new.txt", "x")
        names = wait_until(
            lambda: [e.name for e in handle.get_new_events() if e.name == "new.txt"], 20, what="watch events"
        )
        assert names
    finally:
        handle.stop()

    # Presigned URLs, used as E2B users do: host routing (`<port>-<id>.<domain>`), no headers but Host.
    envd_host = sandbox.get_host(49983)

    def fetch(method: str, url: str, **kwargs) -> httpx.Response:
        parts = httpx.URL(url)
        target = node.url + parts.raw_path.decode()
        return httpx.request(method, target, headers={"Host": envd_host}, timeout=10, **kwargs)

    sandbox.files.write("/tmp/url.txt", "via url")
    url = sandbox.download_url("/tmp/url.txt")
    response = fetch("GET", url)
    assert response.status_code == 200, response.text
    assert response.text == "via url"
    forged = re.sub(r"signature=[^&]+", "signature=v1_forged", url)
    assert fetch("GET", forged).status_code == 401
    upload = sandbox.upload_url("/tmp/uploaded.txt")
    assert fetch("POST", upload, files={"file": ("uploaded.txt", b"up")}).status_code == 200
    assert sandbox.files.read("/tmp/uploaded.txt") == "up"


# -- hosts and the proxy -----------------------------------------------------------------------


def test_get_host_reaches_http_server(sandboxes: Sandboxes, node: NodeServer) -> None:
    sandbox = sandboxes.create()
    host = sandbox.get_host(8001)
    assert host == f"8001-{sandbox.sandbox_id}.{node.domain}"
    sandbox.files.write("/tmp/www/index.html", "served from the sandbox")
    sandbox.commands.run("cd /tmp/www && python3 -m http.server 8001", background=True)
    response = wait_until(
        lambda: (r := proxied_get(node, host)).status_code == 200 and r, 60, what="the sandbox's HTTP server"
    )
    assert response.text == "served from the sandbox"
    closed = proxied_get(node, sandbox.get_host(8002))
    assert closed.status_code == 502
    assert "port is not open" in closed.json()["message"]


# -- list, info, timeout -----------------------------------------------------------------------


def test_list_filters_and_paging(sandboxes: Sandboxes) -> None:
    first = sandboxes.create(metadata={"role": "a", "odd": "x y&z=1"})
    second = sandboxes.create(metadata={"role": "b"})
    third = sandboxes.create(metadata={"role": "b"})
    mine = SandboxQuery(metadata={"e2e": sandboxes.tag})

    def ids(query: SandboxQuery, **kwargs) -> list[str]:
        return [s.sandbox_id for s in Sandbox.list(query=query, **kwargs).next_items()]

    assert sorted(ids(mine)) == sorted([first.sandbox_id, second.sandbox_id, third.sandbox_id])
    assert ids(SandboxQuery(metadata={"e2e": sandboxes.tag, "role": "a"})) == [first.sandbox_id]
    assert ids(SandboxQuery(metadata={"e2e": sandboxes.tag, "odd": "x y&z=1"})) == [first.sandbox_id]
    assert ids(SandboxQuery(metadata={"e2e": sandboxes.tag, "role": "none"})) == []

    assert third.pause()
    running = ids(SandboxQuery(metadata={"e2e": sandboxes.tag}, state=[SandboxState.RUNNING]))
    paused = ids(SandboxQuery(metadata={"e2e": sandboxes.tag}, state=[SandboxState.PAUSED]))
    assert sorted(running) == sorted([first.sandbox_id, second.sandbox_id])
    assert paused == [third.sandbox_id]
    listed = {s.sandbox_id: s for s in Sandbox.list(query=mine).next_items()}
    assert listed[third.sandbox_id].state == SandboxState.PAUSED
    assert listed[first.sandbox_id].metadata["odd"] == "x y&z=1"

    paginator = Sandbox.list(query=mine, limit=2)
    seen = paginator.next_items()
    assert len(seen) == 2 and paginator.has_next
    seen += paginator.next_items()
    assert not paginator.has_next
    assert sorted(s.sandbox_id for s in seen) == sorted(listed)


def test_get_info_and_set_timeout(sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create(timeout=60)
    info = Sandbox.get_info(sandbox.sandbox_id)
    assert info.sandbox_id == sandbox.sandbox_id
    assert info.metadata["e2e"] == sandboxes.tag
    sandbox.set_timeout(600)
    later = sandbox.get_info().end_at
    assert (later - info.end_at).total_seconds() > 400
    sandbox.set_timeout(30)
    assert (sandbox.get_info().end_at - later).total_seconds() < -500
    with pytest.raises(NotFoundException):
        Sandbox.get_info("inotasandbox0000000000")
    with pytest.raises(NotFoundException):
        Sandbox.set_timeout("inotasandbox0000000000", 30)


def test_set_timeout_expires(sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create()
    sandbox.set_timeout(2)
    wait_until(lambda: not sandbox.is_running(), 30, what="the sandbox to expire")
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sandbox.sandbox_id)
    assert not Sandbox.kill(sandbox.sandbox_id)


# -- pause, connect, snapshots, fork, kill -----------------------------------------------------


@pytest.mark.parametrize("how", ["pause", "beta_pause"])
def test_pause_connect_keeps_processes_and_files(sandboxes: Sandboxes, how: str) -> None:
    sandbox = sandboxes.create()
    sandbox.files.write("/tmp/marker", "before pause")
    counter = sandbox.commands.run(
        "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.2; done", background=True
    )
    wait_until(lambda: sandbox.files.exists("/tmp/count"), 20, what="the counter")
    run_in(sandbox, "python3 -c 'import time; time.sleep(0.01)'")
    pid = counter.pid
    counter.disconnect()

    assert getattr(sandbox, how)() in (True, None)
    assert not sandbox.is_running()
    assert sandbox.get_info().state == SandboxState.PAUSED
    assert sandbox.pause() is False  # already paused
    with pytest.raises(SandboxException):
        sandbox.commands.run("true", request_timeout=10)

    resumed = Sandbox.connect(sandbox.sandbox_id)
    assert resumed.sandbox_id == sandbox.sandbox_id
    assert resumed.is_running()
    assert resumed.get_info().state == SandboxState.RUNNING
    assert resumed.files.read("/tmp/marker") == "before pause"
    assert pid in [p.pid for p in resumed.commands.list()]
    before = int(resumed.files.read("/tmp/count"))
    wait_until(lambda: int(resumed.files.read("/tmp/count")) > before, 20, what="the counter to go on")
    # connect on a running sandbox: same sandbox, still usable
    assert run_in(sandbox.connect(), "cat /tmp/marker") == "before pause"


def test_snapshots(sandboxes: Sandboxes) -> None:
    source = sandboxes.create()
    source.files.write("/home/user/state.txt", "snapshotted")
    snapshot = source.create_snapshot()
    assert snapshot.snapshot_id
    assert source.is_running()  # the source keeps running
    source.files.write("/home/user/state.txt", "changed after")

    listed = [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
    assert snapshot.snapshot_id in listed
    assert [s.snapshot_id for s in source.list_snapshots().next_items()] == [snapshot.snapshot_id]

    clone = sandboxes.create(snapshot.snapshot_id)
    assert clone.sandbox_id != source.sandbox_id
    assert clone.files.read("/home/user/state.txt") == "snapshotted"
    assert source.files.read("/home/user/state.txt") == "changed after"

    named = source.create_snapshot(name="e2e-named")
    assert "e2e-named" in (named.names or []) or named.snapshot_id
    by_name = sandboxes.create("e2e-named")
    assert by_name.files.read("/home/user/state.txt") == "changed after"

    assert Sandbox.delete_snapshot(snapshot.snapshot_id)
    assert not Sandbox.delete_snapshot(snapshot.snapshot_id)
    assert snapshot.snapshot_id not in [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
    assert Sandbox.delete_snapshot(named.snapshot_id)
    # a sandbox started from a deleted snapshot keeps working
    assert clone.files.read("/home/user/state.txt") == "snapshotted"


def test_fork(sandboxes: Sandboxes) -> None:
    source = sandboxes.create(metadata={"forked": "yes"})
    source.files.write("/tmp/origin", "parent")
    forks = source.fork(count=2)
    for child in forks:
        assert not isinstance(child, Exception), child
        sandboxes.track(child.sandbox_id)
    assert len({source.sandbox_id, *(c.sandbox_id for c in forks)}) == 3
    for child in forks:
        assert child.files.read("/tmp/origin") == "parent"
        child.files.write("/tmp/origin", child.sandbox_id)
    assert source.files.read("/tmp/origin") == "parent"
    assert source.is_running()


def test_kill(sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create()
    assert sandbox.is_running()
    assert sandbox.kill()
    assert not sandbox.is_running()
    assert not Sandbox.kill(sandbox.sandbox_id)
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sandbox.sandbox_id)
    with pytest.raises(NotFoundException):
        Sandbox.connect(sandbox.sandbox_id)

    paused = sandboxes.create()
    assert paused.pause()
    assert Sandbox.kill(paused.sandbox_id)  # kill works on paused sandboxes too
    with pytest.raises(NotFoundException):
        Sandbox.connect(paused.sandbox_id)


def parked_gauge(node: NodeServer) -> float:
    """`aenv_parked_sandboxes` from the node's public Prometheus endpoint."""
    text = httpx.get(node.url + "/metrics", timeout=10).text
    assert 'aenv_sandboxes{state="' in text and 'aenv_sandbox_creates{result="success"}' in text
    lines = [line for line in text.splitlines() if line.startswith("aenv_parked_sandboxes ")]
    return float(lines[0].split()[1])


def test_paused_sandbox_keeps_its_process(sandboxes: Sandboxes, node: NodeServer) -> None:
    sandbox = sandboxes.create()
    sandbox.files.write("/tmp/parked", "kept")
    sandbox.beta_pause()
    parked = parked_gauge(node)
    assert parked >= 1
    resumed = Sandbox.connect(sandbox.sandbox_id, timeout=120)
    assert resumed.files.read("/tmp/parked") == "kept"
    assert parked_gauge(node) == parked - 1  # other tests' sandboxes are killed, never released by age
