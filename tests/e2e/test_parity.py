"""E2B behaviours the SDK relies on, through the official SDK on a real node: list filters, order
and start-time bounds; network rule changes that reach the running sandbox at once."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, SandboxNotRunningException, SandboxQuery

from tests.network.conftest import INET_ADDRESS, Listener, fake_internet  # noqa: F401 (a fixture)

from .conftest import NodeServer, Sandboxes, wait_until
from .test_js_sdk import installed_sdk, run_script

pytestmark = pytest.mark.vm


def _ids(query: SandboxQuery, **kwargs) -> list[str]:
    return [s.sandbox_id for s in Sandbox.list(query=query, **kwargs).next_items()]


def test_list_order_template_and_start_bounds(node: NodeServer, sandboxes: Sandboxes) -> None:
    first = sandboxes.create()
    second = sandboxes.create()
    mine = {"e2e": sandboxes.tag}
    both = [first.sandbox_id, second.sandbox_id]

    assert _ids(SandboxQuery(metadata=mine), order="asc") == both
    assert _ids(SandboxQuery(metadata=mine), order="desc") == both[::-1]
    assert _ids(SandboxQuery(metadata=mine)) == both[::-1]  # newest first by default

    paginator = Sandbox.list(query=SandboxQuery(metadata=mine), limit=1, order="asc")
    assert [s.sandbox_id for s in paginator.next_items()] == both[:1] and paginator.has_next
    assert [s.sandbox_id for s in paginator.next_items()] == both[1:] and not paginator.has_next

    template_id = first.get_info().template_id
    for template in ("base", template_id, "team/base:latest"):
        assert _ids(SandboxQuery(metadata=mine, template=template), order="asc") == both, template
    assert _ids(SandboxQuery(metadata=mine, template="no-such-template")) == []

    second_started = second.get_info().started_at
    assert _ids(SandboxQuery(metadata=mine, started_after=second_started)) == both[1:]
    first_started = first.get_info().started_at
    # `startedBefore` is not sent by SDK 2.63 but is part of the list contract: raw HTTP.
    answer = httpx.get(
        f"{node.url}/v2/sandboxes",
        params={"startedBefore": first_started.isoformat(), "template": "base"},
        headers={"X-API-Key": node.key},
    )
    assert answer.status_code == 200
    listed = [s["sandboxID"] for s in answer.json()]
    assert first.sandbox_id in listed and second.sandbox_id not in listed

    for bad in (
        {"order": "sideways"},
        {"startedAfter": "yesterday"},
        {"startedBefore": "2026-01-01T00:00:00"},
    ):
        answer = httpx.get(f"{node.url}/v2/sandboxes", params=bad, headers={"X-API-Key": node.key})
        assert answer.status_code == 400 and answer.json()["code"] == 400, bad


def _reads(sandbox, port: int) -> str:
    """What the guest reads from the fake internet host; empty if it cannot connect within 3 s."""
    command = (
        f"timeout 3 bash -c 'exec 3<>/dev/tcp/{INET_ADDRESS}/{port}; head -c 64 <&3' 2>/dev/null || true"
    )
    return sandbox.commands.run(command, timeout=15).stdout


def test_network_update_applies_at_once_and_is_kept_by_pause_and_fork(
    sandboxes: Sandboxes,
    fake_internet,  # noqa: F811 (the imported fixture)
) -> None:
    internet = Listener(fake_internet.namespace)
    try:
        sandbox = sandboxes.create()
        assert _reads(sandbox, internet.port) == internet.token

        sandbox.update_network({"deny_out": [INET_ADDRESS]})
        assert _reads(sandbox, internet.port) == ""
        assert (sandbox.get_info().network or {}).get("deny_out") == [INET_ADDRESS]

        assert sandbox.pause()
        sandbox = Sandbox.connect(sandbox.sandbox_id)
        assert _reads(sandbox, internet.port) == "", "a resumed sandbox lost its network rules"
        child = sandbox.fork(count=1)[0]
        sandboxes.track(child.sandbox_id)
        assert _reads(child, internet.port) == "", "a fork's child lost its source's network rules"

        sandbox.update_network({"allow_internet_access": False, "allow_out": [INET_ADDRESS]})
        assert _reads(sandbox, internet.port) == internet.token  # allowOut wins over the closed internet
        sandbox.update_network({})  # every rule cleared: the internet is open again
        assert _reads(sandbox, internet.port) == internet.token
        sandbox.update_network({"allow_internet_access": False})
        assert _reads(sandbox, internet.port) == ""
        assert _reads(child, internet.port) == ""  # the child's rules are its own
    finally:
        internet.close()


# A guest HTTP server that answers every GET with the Host header it received.
ECHO_HOST_SERVER = """
import http.server, sys
class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = (self.headers.get("Host") or "").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("0.0.0.0", int(sys.argv[1])), Echo).serve_forever()
"""


def _guest_host_header(node: NodeServer, sandbox, port: int) -> str:
    """The Host header a request to the sandbox's port arrives with, sent through the node's proxy."""

    def answer() -> str | None:
        try:
            response = httpx.get(node.url + "/", headers={"Host": sandbox.get_host(port)}, timeout=10)
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None

    return wait_until(answer, 60, interval=0.5, what=f"the guest's HTTP server on port {port}")


def test_mask_request_host_rewrites_the_host_the_guest_sees(node: NodeServer, sandboxes: Sandboxes) -> None:
    masked = sandboxes.create(network={"mask_request_host": "${PORT}-myapp.example.com"})
    plain = sandboxes.create()
    for sandbox in (masked, plain):
        sandbox.files.write("/tmp/echo_host.py", ECHO_HOST_SERVER)
        sandbox.commands.run("python3 /tmp/echo_host.py 8080", background=True)
    assert masked.get_info().network["mask_request_host"] == "${PORT}-myapp.example.com"
    assert _guest_host_header(node, masked, 8080) == "8080-myapp.example.com"
    assert _guest_host_header(node, plain, 8080) == plain.get_host(8080)  # unmasked: the client's
    # envd's port is never masked: the SDK keeps working on the masked sandbox.
    assert masked.commands.run("echo ok").stdout == "ok\n"


def test_kill_during_a_streaming_command_reports_the_sandbox_gone(sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create()
    started = threading.Event()
    killer = threading.Thread(target=lambda: started.wait(60) and Sandbox.kill(sandbox.sandbox_id))
    killer.start()
    try:
        with pytest.raises(SandboxNotRunningException, match="killed"):
            sandbox.commands.run("echo started; sleep 600", on_stdout=lambda _: started.set(), timeout=120)
    finally:
        started.set()
        killer.join()
    assert started.is_set()


KILLED_DURING_RUN_JS = r"""
import { Sandbox, TimeoutError } from 'e2b'

const opts = { apiKey: process.env.AENV_E2E_KEY, apiUrl: process.env.AENV_E2E_URL,
               sandboxUrl: process.env.AENV_E2E_URL }
const sbx = await Sandbox.create('base', { ...opts, timeoutMs: 120_000 })
let outcome
try {
  await sbx.commands.run('echo started; sleep 600', {
    timeoutMs: 120_000,
    onStdout: () => { Sandbox.kill(sbx.sandboxId, opts) },
  })
  outcome = { error: null }
} catch (err) {
  outcome = { error: err.constructor.name, timeout: err instanceof TimeoutError, message: err.message }
} finally {
  await Sandbox.kill(sbx.sandboxId, opts).catch(() => {})
}
console.log(JSON.stringify(outcome))
"""


def test_kill_during_a_streaming_command_js(node: NodeServer, tmp_path: Path) -> None:
    """The npm SDK reports a killed sandbox as a TimeoutError that says so (its `SandboxNotRunning`)."""
    outcome = run_script(node, installed_sdk(tmp_path), "killed_during_run.mjs", KILLED_DURING_RUN_JS)
    assert outcome["timeout"] and "was killed" in outcome["message"], outcome


def _metrics_once(sandbox, count: int) -> list:
    """The sandbox's metrics once it has at least `count` samples."""

    def enough() -> list | None:
        samples = sandbox.get_metrics()
        return samples if len(samples) >= count else None

    return wait_until(enough, 120, interval=2, what=f"{count} metrics samples")


def test_metrics_history_by_range_kept_across_pause(node: NodeServer, sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create()
    other = sandboxes.create()
    samples = _metrics_once(sandbox, 3)
    stamps = [m.timestamp for m in samples]
    assert stamps == sorted(set(stamps)), "samples are oldest first, one per interval"
    created = sandbox.get_info().started_at
    assert all(s >= created.replace(microsecond=0) for s in stamps), "no samples from before the sandbox"
    assert all(m.mem_total > m.mem_used > 0 and m.disk_total > 0 and m.cpu_count >= 1 for m in samples)

    middle = stamps[1]
    assert [m.timestamp for m in sandbox.get_metrics(start=middle, end=middle)] == [middle]
    assert [m.timestamp for m in sandbox.get_metrics(start=middle)][: len(stamps) - 1] == stamps[1:]
    assert [m.timestamp for m in sandbox.get_metrics(end=middle)] == stamps[:2]

    assert sandbox.pause()
    while_paused = [m.timestamp for m in Sandbox.get_metrics(sandbox.sandbox_id)]
    assert while_paused[: len(stamps)] == stamps, "a paused sandbox still has its history"
    resumed = Sandbox.connect(sandbox.sandbox_id)
    after = _metrics_once(resumed, len(while_paused) + 1)
    assert [m.timestamp for m in after][: len(while_paused)] == while_paused

    # Several sandboxes at once (E2B's `GET /sandboxes/metrics`): the newest sample of each.
    ids = [sandbox.sandbox_id, other.sandbox_id, "inosuchsandbox"]
    key = {"X-API-Key": node.key}
    answer = httpx.get(f"{node.url}/sandboxes/metrics", params={"sandbox_ids": ",".join(ids)}, headers=key)
    assert answer.status_code == 200, answer.text
    latest = answer.json()["sandboxes"]
    assert sorted(latest) == sorted(ids[:2])
    assert latest[sandbox.sandbox_id]["timestampUnix"] >= int(after[-1].timestamp.timestamp())
    for bad in ({}, {"sandbox_ids": ""}):
        refused = httpx.get(f"{node.url}/sandboxes/metrics", params=bad, headers={"X-API-Key": node.key})
        assert refused.status_code == 400 and refused.json()["code"] == 400
    refused = httpx.get(
        f"{node.url}/sandboxes/{sandbox.sandbox_id}/metrics",
        params={"start": 20, "end": 10},
        headers={"X-API-Key": node.key},
    )
    assert refused.status_code == 400


# A resume or create that boots the guest (rather than restoring it) takes a while under TCG.
BOOT_WAIT = 300


def _boot_id(sandbox) -> str:
    return sandbox.commands.run("cat /proc/sys/kernel/random/boot_id").stdout.strip()


def test_filesystem_only_pause_and_reboot_keep_the_disk_only(sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create(envs={"FROM_CREATE": "yes"})
    first_boot = _boot_id(sandbox)
    sandbox.files.write("/home/user/kept.txt", "kept")
    sandbox.commands.run("sleep 600", background=True)

    assert sandbox.pause(mode="filesystem")
    assert Sandbox.get_info(sandbox.sandbox_id).state.value == "paused"
    booted = Sandbox.connect(sandbox.sandbox_id, request_timeout=BOOT_WAIT)
    second_boot = _boot_id(booted)
    assert second_boot != first_boot, "a filesystem-only pause resumes by booting afresh"
    assert booted.files.read("/home/user/kept.txt") == "kept"
    assert booted.commands.run("echo $FROM_CREATE").stdout == "yes\n", "envd lost the sandbox's variables"
    assert not any(p.cmd == "sleep" or "sleep 600" in " ".join(p.args) for p in booted.commands.list())

    # The booted guest pauses with its memory like any other...
    sleeper = booted.commands.run("sleep 600", background=True)
    assert booted.pause()
    restored = Sandbox.connect(sandbox.sandbox_id)
    assert _boot_id(restored) == second_boot
    assert any(p.pid == sleeper.pid for p in restored.commands.list())
    # ...and a resume may ignore the memory a pause kept (`on_resume="reboot"`: `memory: false`).
    restored.files.write("/home/user/kept.txt", "kept twice")
    restored.commands.run("sync")
    assert restored.pause()
    rebooted = Sandbox.connect(sandbox.sandbox_id, on_resume="reboot", request_timeout=BOOT_WAIT)
    third_boot = _boot_id(rebooted)
    assert third_boot not in (first_boot, second_boot)
    assert rebooted.files.read("/home/user/kept.txt") == "kept twice"

    # A filesystem-only snapshot: sandboxes created from it boot from its disk; the source runs on.
    rebooted.files.write("/home/user/snap.txt", "in the snapshot")
    snapshot = rebooted.create_snapshot(mode="filesystem")
    child = sandboxes.create(snapshot.snapshot_id, request_timeout=BOOT_WAIT)
    assert _boot_id(child) not in (first_boot, second_boot, third_boot)
    assert child.files.read("/home/user/snap.txt") == "in the snapshot"
    assert _boot_id(rebooted) == third_boot
    child.kill()
    assert Sandbox.delete_snapshot(snapshot.snapshot_id)


def test_timeout_pause_without_memory(node: NodeServer, sandboxes: Sandboxes) -> None:
    lifecycle = {"on_timeout": {"action": "pause", "mode": "filesystem"}}
    sandbox = sandboxes.create(lifecycle=lifecycle, timeout=20)
    first_boot = _boot_id(sandbox)
    sandbox.files.write("/home/user/kept.txt", "kept")
    sandbox.commands.run("sync")
    wait_until(lambda: Sandbox.get_info(sandbox.sandbox_id).state.value == "paused", 180, interval=1)
    booted = Sandbox.connect(sandbox.sandbox_id, request_timeout=BOOT_WAIT)
    assert _boot_id(booted) != first_boot
    assert booted.files.read("/home/user/kept.txt") == "kept"

    # E2B's rule: a filesystem-only auto-pause needs autoPause and excludes autoResume.
    for body in (
        {"templateID": "base", "autoPauseMemory": False},
        {"templateID": "base", "autoPause": True, "autoPauseMemory": False, "autoResume": {"enabled": True}},
    ):
        answer = httpx.post(f"{node.url}/v2/sandboxes", json=body, headers={"X-API-Key": node.key})
        assert answer.status_code == 400 and answer.json()["code"] == 400, answer.text
