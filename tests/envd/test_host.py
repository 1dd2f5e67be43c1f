"""Host-only envd tests: wire details the SDK does not exercise (raw HTTP), auth, /init, async SDK paths."""

from __future__ import annotations

import asyncio
import base64
import gzip
import http.client
import json
import os
import pwd
import struct
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from e2b import AsyncSandbox, AuthenticationException
from e2b.connection_config import ConnectionConfig
from packaging.version import Version

from aenv.agent.envd import ENVD_VERSION
from tests.conftest import wait_for

from .conftest import EnvdProcess, run_envd, sdk_sandbox


def _headers(envd: EnvdProcess, stream: bool = True, **extra: str) -> dict[str, str]:
    h = {
        "Content-Type": "application/connect+json" if stream else "application/json",
        "Connect-Protocol-Version": "1",
    }
    if envd.token:
        h["X-Access-Token"] = envd.token
    h.update(extra)
    return h


def _envelope(msg: dict) -> bytes:
    payload = json.dumps(msg).encode()
    return struct.pack(">BI", 0, len(payload)) + payload


def _read_frames(resp: httpx.Response) -> list[tuple[int, dict]]:
    """Parse a whole connect+json response body into (flags, message) frames."""
    frames, buf = [], b""
    for chunk in resp.iter_bytes():
        buf += chunk
        while len(buf) >= 5:
            flags, length = struct.unpack(">BI", buf[:5])
            if len(buf) < 5 + length:
                break
            frames.append((flags, json.loads(buf[5 : 5 + length])))
            buf = buf[5 + length :]
    assert buf == b""
    return frames


def _start(envd: EnvdProcess, script: str, cwd: str | None = None, **headers: str) -> list[tuple[int, dict]]:
    body: dict = {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", script]}, "stdin": False}
    if cwd:
        body["process"]["cwd"] = cwd
    return _start_raw(envd, body, **headers)


def _start_raw(envd: EnvdProcess, body: dict, **headers: str) -> list[tuple[int, dict]]:
    with httpx.stream(
        "POST",
        envd.url + "/process.Process/Start",
        content=_envelope(body),
        headers=_headers(envd, **headers),
        timeout=30,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "application/connect+json"
        return _read_frames(r)


def _unary(envd: EnvdProcess, method: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(f"{envd.url}/{method}", json=body, headers=_headers(envd, stream=False, **headers))


def test_keepalive_frames_and_end_stream(envd_server):
    frames = _start(envd_server, "sleep 2.3; echo hi", **{"Keepalive-Ping-Interval": "1"})
    events = [m.get("event", {}) for flags, m in frames if flags == 0]
    assert "start" in events[0] and events[0]["start"]["pid"] > 0
    assert sum("keepalive" in e for e in events) >= 2
    assert {"data": {"stdout": base64.b64encode(b"hi\n").decode()}} in events
    assert events[-1]["end"] == {"exitCode": 0, "exited": True, "status": "exit status 0"}
    assert frames[-1] == (2, {})


def test_error_in_end_stream_frame(envd_server, tmp_path):
    frames = _start(envd_server, "true", cwd=str(tmp_path / "nope"))
    assert len(frames) == 1
    flags, msg = frames[0]
    assert flags == 2 and msg["error"]["code"] == "invalid_argument"
    assert "does not exist" in msg["error"]["message"]


def test_deadline_ends_stream_and_kills(envd_server):
    frames = _start(envd_server, "echo started; sleep 30", **{"Connect-Timeout-Ms": "700"})
    pid = frames[0][1]["event"]["start"]["pid"]
    assert frames[-1][0] == 2 and frames[-1][1]["error"]["code"] == "deadline_exceeded"
    time.sleep(0.3)
    listed = _unary(envd_server, "process.Process/List", {}).json()["processes"]
    assert pid not in [p["pid"] for p in listed]


def test_unary_errors(envd_server):
    r = _unary(envd_server, "filesystem.Filesystem/Stat", {"path": "/definitely/not/here"})
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = _unary(envd_server, "process.Process/SendSignal", {"process": {"pid": 1}, "signal": "SIGNAL_SIGKILL"})
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = httpx.post(
        envd_server.url + "/process.Process/List",
        content=b"{}",
        headers=_headers(envd_server, stream=False, **{"Content-Type": "application/proto"}),
    )
    assert r.status_code == 415
    bad_user = {"Authorization": "Basic " + base64.b64encode(b"no-such-user:").decode()}
    r = _unary(envd_server, "filesystem.Filesystem/Stat", {"path": "/"}, **bad_user)
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"


def test_entry_info_wire_format(envd_server, tmp_path):
    (tmp_path / "f.txt").write_text("12345")
    r = _unary(envd_server, "filesystem.Filesystem/Stat", {"path": str(tmp_path / "f.txt")})
    entry = r.json()["entry"]
    assert entry["type"] == "FILE_TYPE_FILE" and entry["size"] == "5" and entry["name"] == "f.txt"
    assert entry["permissions"].startswith("-rw") and isinstance(entry["mode"], int)
    assert entry["modifiedTime"].endswith("Z")


def test_access_token_required(envd_server):
    r = httpx.post(envd_server.url + "/process.Process/List", json={})
    assert r.status_code == 401
    assert r.json() == {
        "code": 401,
        "message": "unauthorized access, please provide a valid access token or method signing if supported",
    }
    assert httpx.get(envd_server.url + "/health").status_code == 204
    assert httpx.get(envd_server.url + "/envs").status_code == 401


def test_wrong_token_sdk(envd_server):
    bad = sdk_sandbox(envd_server, token="wrong-token")
    with pytest.raises(AuthenticationException):
        bad.commands.run("true")
    with pytest.raises(AuthenticationException):
        bad.files.list("/")
    with pytest.raises(AuthenticationException):
        bad.files.read("/etc/hostname")


def test_init_envs_clock_entropy(envd_server):
    assert (
        httpx.get(envd_server.url + "/envs", headers=_headers(envd_server)).json()["AENV_SANDBOX_VAR"]
        == "from-init"
    )
    now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
    body = {"timestamp": now, "entropy": base64.b64encode(b"\x01" * 64).decode(), "envVars": {"B": "2"}}
    assert httpx.post(envd_server.url + "/init", json=body).status_code == 401  # token already set
    r = httpx.post(envd_server.url + "/init", json=body, headers={"X-Access-Token": envd_server.token})
    assert r.status_code == 204
    envs = httpx.get(envd_server.url + "/envs", headers=_headers(envd_server)).json()
    assert envs == {"AENV_SANDBOX_VAR": "from-init", "B": "2"}
    out = sdk_sandbox(envd_server).commands.run('echo "$AENV_SANDBOX_VAR $B"', user="root").stdout
    assert out == "from-init 2\n"
    for bad in ({"timestamp": "yesterday"}, {"entropy": "***"}):
        r = httpx.post(envd_server.url + "/init", json=bad, headers={"X-Access-Token": envd_server.token})
        assert r.status_code == 400 and r.json()["code"] == 400


def test_metrics(envd_server):
    m = httpx.get(envd_server.url + "/metrics", headers=_headers(envd_server)).json()
    for key in (
        "ts",
        "cpu_count",
        "cpu_used_pct",
        "mem_total",
        "mem_used",
        "mem_cache",
        "mem_total_mib",
        "mem_used_mib",
        "disk_used",
        "disk_total",
    ):
        assert key in m
    assert m["mem_total"] > m["mem_used"] > 0 and m["disk_total"] > 0


def test_metrics_history(envd_server):
    """envd samples at start-up and every interval after; the node asks for a range of them."""
    url = envd_server.url + "/metrics/history"
    history = httpx.get(url, headers=_headers(envd_server)).json()
    assert history["interval"] > 0 and history["samples"], history
    assert 0 <= history["next_in"] <= history["interval"]  # the running time until the next sample
    first = history["samples"][0]
    assert first["mem_total"] > 0 and "cpu_used_pct" in first and "disk_used" in first
    stamps = [s["ts"] for s in history["samples"]]
    assert stamps == sorted(stamps)
    later = httpx.get(url, params={"start": stamps[-1] + 1}, headers=_headers(envd_server)).json()
    assert all(s["ts"] > stamps[-1] for s in later["samples"])
    before = httpx.get(url, params={"end": first["ts"] - 1}, headers=_headers(envd_server)).json()
    assert before["samples"] == []
    assert httpx.get(url, params={"start": "soon"}, headers=_headers(envd_server)).status_code == 400
    assert httpx.get(url).status_code == 401  # the access token guards it like /metrics


def test_health_reports_version(envd_server):
    r = httpx.get(envd_server.url + "/health")
    assert r.status_code == 204 and r.headers["X-Envd-Version"] == ENVD_VERSION
    assert Version(ENVD_VERSION) >= Version("0.6.4")


def test_files_raw_encodings_and_errors(envd_server, tmp_path):
    data = b"x" * 10000
    url = envd_server.url + "/files"
    auth = {"X-Access-Token": envd_server.token}
    r = httpx.post(
        url,
        params={"path": str(tmp_path / "g.bin")},
        content=gzip.compress(data),
        headers={**auth, "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
    )
    assert r.status_code == 200 and r.json()[0]["path"] == str(tmp_path / "g.bin")
    assert (tmp_path / "g.bin").read_bytes() == data
    params = {"path": str(tmp_path / "g.bin")}
    with httpx.Client() as c:
        r = c.get(url, params=params, headers={**auth, "Accept-Encoding": "gzip"})
        assert r.headers["content-encoding"] == "gzip" and r.content == data
        r = c.get(url, params=params, headers={**auth, "Accept-Encoding": "identity"})
        assert "content-encoding" not in r.headers and r.headers["content-length"] == "10000"
    assert httpx.get(url, params={"path": str(tmp_path)}, headers=auth).status_code == 400
    r = httpx.get(url, params={"path": str(tmp_path / "nope")}, headers=auth)
    assert r.status_code == 404 and r.json()["code"] == 404
    assert (
        httpx.get(url, params={"path": "/etc/hostname", "username": "no-such-user"}, headers=auth).status_code
        == 401
    )
    assert (
        httpx.post(
            url, content=b"x", headers={**auth, "Content-Type": "application/octet-stream"}
        ).status_code
        == 400
    )


def test_signed_urls(envd_server, tmp_path):
    sbx = sdk_sandbox(envd_server)
    target = str(tmp_path / "signed.txt")
    up = sbx.upload_url(target, user="root")
    assert "signature=" in up
    assert httpx.post(up, files={"file": ("signed.txt", b"signed!")}).status_code == 200
    assert Path(target).read_bytes() == b"signed!"
    down = sbx.download_url(target, user="root", use_signature_expiration=60)
    assert httpx.get(down).content == b"signed!"
    assert httpx.get(down.replace("signature=v1_", "signature=v1_X")).status_code == 401
    assert httpx.get(envd_server.url + "/files", params={"path": target}).status_code == 401
    expired = sbx.download_url(target, user="root", use_signature_expiration=-10)
    assert httpx.get(expired).status_code == 401


async def test_async_watch_dir_stream(envd_server, tmp_path):
    headers = {"X-Access-Token": envd_server.token, "E2b-Sandbox-Id": "envdtest", "E2b-Sandbox-Port": "49983"}
    config = ConnectionConfig(debug=True, sandbox_url=envd_server.url, extra_sandbox_headers=headers)
    sbx = AsyncSandbox(
        sandbox_id="envdtest",
        sandbox_domain=None,
        envd_version=Version(ENVD_VERSION),
        envd_access_token=envd_server.token,
        traffic_access_token=None,
        connection_config=config,
    )
    events = []
    handle = await sbx.files.watch_dir(str(tmp_path), events.append, recursive=True, include_entry=True)
    try:
        await sbx.files.write(str(tmp_path / "a.txt"), "a")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(e.name == "a.txt" for e in events):
            await asyncio.sleep(0.05)
        assert any(e.name == "a.txt" and e.type.value == "create" for e in events)
        r = await sbx.commands.run("echo async", user="root")
        assert r.stdout == "async\n"
    finally:
        await handle.stop()


def test_clock_helpers():
    from aenv.agent.envd.system_api import parse_rfc3339_ns

    ts = datetime(2025, 1, 2, 3, 4, 5, 123456, tzinfo=UTC)
    assert parse_rfc3339_ns("2025-01-02T03:04:05.123456789Z") == int(ts.timestamp()) * 10**9 + 123456000
    assert (
        parse_rfc3339_ns("2025-01-02T05:04:05+02:00")
        == int((ts - timedelta(microseconds=123456)).timestamp()) * 10**9
    )


# -- bad input: JSON 4xx errors, never a 500 --------------------------------------------------------------


def _assert_json_error(r: httpx.Response, status: int) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["code"] == status and body["message"]


def _assert_invalid_argument(r: httpx.Response) -> None:
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "invalid_argument"


def test_files_bad_input(envd_server, tmp_path):
    url, auth = envd_server.url + "/files", {"X-Access-Token": envd_server.token}
    for params in ({"path": "/" + "a" * 5000}, {"path": "/etc/\x00"}, {"path": str(tmp_path / ("b" * 300))}):
        _assert_json_error(httpx.get(url, params=params, headers=auth), 400)
    _assert_json_error(
        httpx.get(url, params={"path": "/etc/hostname", "username": "root\x00"}, headers=auth), 401
    )
    r = httpx.get(url, params={"path": "/etc/hostname"}, headers={**auth, "Accept-Encoding": "gzip;q=abc"})
    assert r.status_code == 200
    target = {"path": str(tmp_path / "up.txt")}
    raw = {**auth, "Content-Type": "application/octet-stream"}
    for content, headers in (
        (b"zzz", {**auth, "Content-Type": "multipart/form-data"}),
        (b"zzz", {**auth, "Content-Type": "multipart/form-data; boundary=abc"}),
        (b"not gzip", {**raw, "Content-Encoding": "gzip"}),
        (b"x", {**raw, "X-Metadata-" + "k" * 300: "v"}),
        (b"x", {**raw, "X-Metadata-k": "v" * 8000}),
    ):
        _assert_json_error(httpx.post(url, params=target, content=content, headers=headers), 400)
    _assert_json_error(httpx.post(url, params={"path": "/a\x00"}, content=b"x", headers=raw), 400)
    r = httpx.delete(envd_server.url + "/envs", headers=auth)
    _assert_json_error(r, 405)
    assert "GET" in r.headers["Allow"]
    r = httpx.get(envd_server.url + "/envs", headers={"X-Access-Token": "t\xffk".encode("latin-1")})
    _assert_json_error(r, 401)


def test_rpc_bad_input(envd_server):
    for method, body in (
        ("process.Process/SendSignal", {"process": {"pid": "abc"}, "signal": "SIGNAL_SIGKILL"}),
        ("process.Process/SendSignal", {"process": {"pid": -1}, "signal": "SIGNAL_SIGKILL"}),
        ("process.Process/SendSignal", {"process": {"pid": 2**40}, "signal": "SIGNAL_SIGKILL"}),
        ("process.Process/SendSignal", {"process": {}, "signal": "SIGNAL_SIGKILL"}),
        ("process.Process/SendInput", {"process": {"pid": [1]}}),
        ("process.Process/Update", {"process": "pid"}),
        ("filesystem.Filesystem/ListDir", {"path": "/", "depth": "deep"}),
        ("filesystem.Filesystem/ListDir", {"path": 5}),
        ("filesystem.Filesystem/Stat", {"path": "/\x00"}),
        ("filesystem.Filesystem/Move", {"source": "/tmp", "destination": "/" + "d" * 5000}),
        ("filesystem.Filesystem/CreateWatcher", {"path": "/tmp", "recursive": "yes"}),
        ("filesystem.Filesystem/GetWatcherEvents", {"watcherId": {}}),
    ):
        _assert_invalid_argument(_unary(envd_server, method, body))
    for method, raw in (
        ("filesystem.Filesystem/Stat", b"[" * 100_000),
        ("filesystem.Filesystem/Stat", b'{"path": "\\ud800"}'),
        ("process.Process/SendSignal", b'{"process": {"pid": 1e400}, "signal": 9}'),
    ):
        r = httpx.post(
            f"{envd_server.url}/{method}", content=raw, headers=_headers(envd_server, stream=False)
        )
        _assert_invalid_argument(r)
    r = httpx.post(
        envd_server.url + "/process.Process/List",
        content=b" " * (17 << 20),
        headers=_headers(envd_server, stream=False),
    )
    assert r.status_code == 429 and r.json()["code"] == "resource_exhausted"


def test_start_bad_input(envd_server):
    for body in (
        {"process": {"cmd": "/bin/true", "args": ["a\x00"]}},
        {"process": {"cmd": "/bin/true", "args": "not a list"}},
        {"process": {"cmd": "/bin/true", "envs": {"": "x"}}},
        {"process": {"cmd": "/bin/true", "envs": {"A": 1}}},
        {"process": {"cmd": 5}},
        {"process": {"cmd": "/bin/true", "cwd": "/" + "c" * 5000}},
        {"process": {"cmd": "/bin/true"}, "pty": {"size": {"rows": 70_000, "cols": 80}}},
        {"process": {"cmd": "/bin/true"}, "stdin": "yes"},
        {"process": {"cmd": "/bin/true", "args": ["x" * (1 << 20)]}},
    ):
        [(flags, msg)] = _start_raw(envd_server, body)
        assert flags == 2 and msg["error"]["code"] == "invalid_argument", msg


def test_a_program_that_cannot_start_is_invalid_argument(envd_server, tmp_path):
    not_executable = tmp_path / "plain.txt"
    not_executable.write_text("echo no\n")
    for cmd, reason in (
        ("/no/such/program", "No such file or directory: '/no/such/program'"),
        ("no-such-program-on-path", "No such file or directory: 'no-such-program-on-path'"),
        (str(not_executable), "Permission denied"),
    ):
        [(flags, msg)] = _start_raw(envd_server, {"process": {"cmd": cmd}})
        assert flags == 2 and msg["error"]["code"] == "invalid_argument", msg
        message = msg["error"]["message"]
        assert message.startswith("failed to start process: [Errno") and reason in message
    [(_, listed)] = _unary(envd_server, "process.Process/List", {}).json().items()
    assert listed == []  # nothing was left running, and each helper was reaped


def test_a_command_runs_as_its_user_with_the_oom_score_of_a_command(envd_server):
    nobody = pwd.getpwnam("nobody")
    sandbox = sdk_sandbox(envd_server)
    ids = "id -u; id -g; id -G; cat /proc/self/oom_score_adj"
    out = sandbox.commands.run(ids, user="nobody", cwd="/").stdout.split("\n")
    groups = os.getgrouplist("nobody", nobody.pw_gid)
    assert out[:4] == [str(nobody.pw_uid), str(nobody.pw_gid), " ".join(map(str, groups)), "100"]
    assert sandbox.commands.run("true").exit_code == 0  # found on PATH


def test_signals_envd_does_not_send_are_refused(envd_server):
    body = {"process": {"cmd": "/bin/sleep", "args": ["30"]}, "stdin": False}
    with httpx.stream(
        "POST",
        envd_server.url + "/process.Process/Start",
        content=_envelope(body),
        headers=_headers(envd_server),
    ) as r:
        chunks = r.iter_raw()
        pid = _first_message(chunks)["event"]["start"]["pid"]
        for signal in ("SIGNAL_SIGINT", "SIGNAL_UNSPECIFIED", 2, True, {"x": 1}, None):
            r2 = _unary(
                envd_server, "process.Process/SendSignal", {"process": {"pid": pid}, "signal": signal}
            )
            _assert_invalid_argument(r2)
        r2 = _unary(envd_server, "process.Process/SendSignal", {"process": {"pid": pid}, "signal": 9})
        assert r2.status_code == 200


def test_init_bad_input(envd_server):
    auth = {"X-Access-Token": envd_server.token}
    before = httpx.get(envd_server.url + "/envs", headers=auth).json()
    for body in (
        {"envVars": {"A": 1}},
        {"envVars": ["A"]},
        {"accessToken": 5},
        {"defaultUser": "x\x00"},
        {"defaultWorkdir": "/" + "w" * 5000},
        {"timestamp": 5},
    ):
        _assert_json_error(httpx.post(envd_server.url + "/init", json=body, headers=auth), 400)
    _assert_json_error(httpx.post(envd_server.url + "/init", content=b"[" * 100_000, headers=auth), 400)
    assert httpx.get(envd_server.url + "/envs", headers=auth).json() == before


def test_unusable_sandbox_variables_fail_commands_clearly(tmp_path):
    """/init keeps what the node sends; a variable no process can get makes commands invalid_argument."""
    with run_envd(tmp_path, token="t", env_vars={"A=B": "x"}) as envd:
        [(flags, msg)] = _start_raw(envd, {"process": {"cmd": "/bin/true"}})
        assert flags == 2 and msg["error"] == {
            "code": "invalid_argument",
            "message": "invalid environment variable name 'A=B'",
        }


def test_init_settings_survive_an_envd_restart(tmp_path):
    store = tmp_path / "run" / "envd.json"
    with run_envd(tmp_path / "first", token="the-token", env_vars={"K": "v"}, state_file=store):
        pass
    assert store.stat().st_mode & 0o777 == 0o600
    with run_envd(tmp_path / "second", state_file=store) as envd:  # not initialised again
        assert httpx.get(envd.url + "/envs").status_code == 401
        assert httpx.get(envd.url + "/envs", headers={"X-Access-Token": "the-token"}).json() == {"K": "v"}


def test_unread_stream_stops_the_writer(envd_server):
    """A client that reads nothing leaves the output in the pipe: the writer blocks, envd stays small."""
    peak_before = _peak_rss_kib(envd_server.proc.pid)
    body = {"process": {"cmd": "/usr/bin/head", "args": ["-c", "256M", "/dev/zero"]}, "stdin": False}
    with httpx.stream(
        "POST",
        envd_server.url + "/process.Process/Start",
        content=_envelope(body),
        headers=_headers(envd_server),
    ) as r:
        chunks = r.iter_raw()  # held: dropping it would close the stream
        pid = _first_message(chunks)["event"]["start"]["pid"]
        written: list[int] = []

        def writer_blocked() -> bool:
            written.append(_written_bytes(pid))
            return len(written) >= 5 and len(set(written[-5:])) == 1

        wait_for(writer_blocked, timeout=60, interval=0.2)
        assert written[-1] < 16 << 20
        assert _peak_rss_kib(envd_server.proc.pid) - peak_before < 64 << 10
        _unary(
            envd_server, "process.Process/SendSignal", {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}
        )


def _written_bytes(pid: int) -> int:
    io = Path(f"/proc/{pid}/io").read_text()
    return int(next(line for line in io.splitlines() if line.startswith("wchar:")).split()[1])


def _peak_rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1])


def _first_message(chunks: Iterator[bytes]) -> dict:
    """The first message of a stream, leaving the rest unread (and the stream open: keep `chunks`)."""
    buf = b""
    for chunk in chunks:
        buf += chunk
        if len(buf) >= 5 and len(buf) >= 5 + struct.unpack(">I", buf[1:5])[0]:
            return json.loads(buf[5 : 5 + struct.unpack(">I", buf[1:5])[0]])
    raise AssertionError("stream ended before its first message")


def test_fifos_are_refused_not_waited_on(envd_server, tmp_path):
    """Opening a FIFO blocks until its peer comes: envd must refuse it rather than lose a worker."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    url, auth = envd_server.url + "/files", {"X-Access-Token": envd_server.token}
    raw = {**auth, "Content-Type": "application/octet-stream"}
    for _ in range(10):  # more than envd's worker threads
        _assert_json_error(httpx.get(url, params={"path": str(fifo)}, headers=auth), 400)
        _assert_json_error(httpx.post(url, params={"path": str(fifo)}, content=b"x", headers=raw), 400)
    r = _unary(envd_server, "filesystem.Filesystem/Stat", {"path": str(fifo)})
    assert r.status_code == 200


def test_the_nodes_init_is_answered_before_aiohttp_and_the_rest_by_aiohttp(tmp_path):
    """From the host peer, well-formed `/init`s on a kept-alive connection are answered by the
    short path (no aiohttp `Server` header); the first other request hands the connection to
    aiohttp, which then also answers `/init` (with its errors for bad bodies)."""
    with run_envd(tmp_path, host_peer="127.0.0.1") as envd:
        conn = http.client.HTTPConnection(envd.url.removeprefix("http://"), timeout=10)

        def call(
            method: str, path: str, body: bytes | None = None, token: str = ""
        ) -> tuple[int, dict, bytes]:
            conn.request(method, path, body=body, headers={"X-Access-Token": token} if token else {})
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read()

        for body in ({"accessToken": "t0k", "envVars": {"A": "1"}}, {"envVars": {"B": "2"}}):
            status, headers, _ = call("POST", "/init", json.dumps(body).encode())
            assert status == 204 and "Server" not in headers
        status, headers, answer = call("GET", "/envs", token="t0k")
        assert (status, json.loads(answer)) == (200, {"A": "1", "B": "2"}) and "Server" in headers
        status, headers, answer = call("POST", "/init", b"[1")
        assert status == 400 and json.loads(answer)["message"] == "invalid JSON body"
        fresh = http.client.HTTPConnection(envd.url.removeprefix("http://"), timeout=10)
        fresh.request("POST", "/init", body=b'{"defaultUser": "a\\u0000b"}')
        refused = fresh.getresponse()
        assert refused.status == 400 and "NUL" in json.loads(refused.read())["message"]
        assert httpx.get(envd.url + "/envs", headers={"X-Access-Token": "t0k"}).json() == {"A": "1", "B": "2"}


def test_the_nodes_metrics_history_is_answered_before_aiohttp(tmp_path):
    """The node fetches samples before each pause: from the host peer, with the token, the short
    path answers it as aiohttp would; no token, a bad bound or an unknown parameter go to aiohttp."""
    with run_envd(tmp_path, host_peer="127.0.0.1") as envd:
        assert httpx.post(envd.url + "/init", json={"accessToken": "t0k"}).status_code == 204
        token = {"X-Access-Token": "t0k"}
        url = envd.url + "/metrics/history"
        short = httpx.get(url, params={"start": 0}, headers=token)
        assert short.status_code == 200 and "Server" not in short.headers, short.headers
        full = httpx.get(url, params={"start": 0, "other": 1}, headers=token)
        assert full.status_code == 200 and "Server" in full.headers
        assert short.json()["interval"] == full.json()["interval"] > 0
        assert 0 <= short.json()["next_in"] <= short.json()["interval"]
        assert short.json()["samples"] == full.json()["samples"][: len(short.json()["samples"])]
        newest = short.json()["samples"][-1]["ts"]
        assert httpx.get(url, params={"start": newest + 1}, headers=token).json()["samples"] == []
        assert [s["ts"] for s in httpx.get(url, params={"end": newest}, headers=token).json()["samples"]][
            -1
        ] == newest
        _assert_json_error(httpx.get(url), 401)
        _assert_json_error(httpx.get(url, headers={"X-Access-Token": "wrong"}), 401)
        _assert_json_error(httpx.get(url, params={"start": "x"}, headers=token), 400)


def test_an_init_that_changes_nothing_writes_no_state(tmp_path):
    """A resume's /init repeats the sandbox's settings: the store is left as it is, also when it
    brings entropy (a restored guest's first); a change is kept (written right after the answer
    went out, so the test waits for it)."""
    store = tmp_path / "run" / "envd.json"
    with run_envd(tmp_path / "envd", token="the-token", env_vars={"K": "v"}, state_file=store) as envd:
        wait_for(lambda: store.exists(), timeout=5)
        written = store.stat().st_mtime_ns
        os.utime(store, ns=(written - 10**9, written - 10**9))
        body = {
            "accessToken": "the-token",
            "envVars": {"K": "v"},
            "timestamp": datetime.now(UTC).isoformat(),
            "entropy": base64.b64encode(os.urandom(64)).decode(),
        }
        headers = {"X-Access-Token": "the-token"}
        assert httpx.post(envd.url + "/init", json=body, headers=headers).status_code == 204
        assert store.stat().st_mtime_ns == written - 10**9
        body["envVars"] = {"K": "w"}
        assert httpx.post(envd.url + "/init", json=body, headers=headers).status_code == 204
        wait_for(lambda: json.loads(store.read_bytes())["env_vars"] == {"K": "w"}, timeout=5)


def test_the_node_can_take_the_token_away(tmp_path):
    """An `/init` with an empty `accessToken` leaves the guest without one (the node gives an
    unsecured sandbox a guest restored with a token); without the field (one that only sets the
    clock), the token and the variables stay."""
    store = tmp_path / "run" / "envd.json"
    with run_envd(tmp_path / "envd", host_peer="127.0.0.1", state_file=store) as envd:
        assert httpx.post(envd.url + "/init", json={"accessToken": "t0k"}).status_code == 204
        _assert_json_error(httpx.get(envd.url + "/envs"), 401)
        assert httpx.post(envd.url + "/init", json={"envVars": {"A": "1"}}).status_code == 204
        _assert_json_error(httpx.get(envd.url + "/envs"), 401)
        clock_only = {"timestamp": datetime.now(UTC).isoformat()}  # what the node sends to set the clock
        assert httpx.post(envd.url + "/init", json=clock_only).status_code == 204
        assert httpx.get(envd.url + "/envs", headers={"X-Access-Token": "t0k"}).json() == {"A": "1"}
        assert httpx.post(envd.url + "/init", json={"accessToken": ""}).status_code == 204
        assert httpx.get(envd.url + "/envs").json() == {"A": "1"}
        wait_for(lambda: json.loads(store.read_bytes())["access_token"] is None, timeout=5)
