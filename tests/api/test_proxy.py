"""The sandbox proxy on a real VM: the E2B SDK in single-URL mode, host routing, SSE, WebSocket, errors."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest
from aiohttp import ClientSession, WSMsgType, web

from aenv.agent.envd import ENVD_PORT
from aenv.api.proxy import ProxyTarget, SandboxAccess, SandboxProxy
from tests.conftest import NodeLoop, RunningSandbox, SandboxManager, wait_for

pytestmark = pytest.mark.vm

DOMAIN = "test.local"
UNKNOWN_ID = "tdeadbeef0000"
TRAFFIC_TOKEN = "traffic-" + "ab" * 16

# Server-sent events: `n` events 0.3 s apart (forever if n < 0), then the connection closes.
SSE_SERVER = r"""
import http.server, itertools, sys, time
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        n = int(self.path.partition("n=")[2] or 5)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        for i in itertools.count() if n < 0 else range(n):
            self.wfile.write(f"id: {i}\ndata: tick {i}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.3)
    def log_message(self, *args): pass
http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Handler).serve_forever()
"""

# A minimal RFC 6455 echo server: unfragmented frames, ping -> pong, close echoed.
WS_SERVER = r"""
import base64, hashlib, socketserver, struct, sys
GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
def frame(opcode, data):
    n = len(data)
    if n < 126:
        size = bytes([n])
    else:
        size = b"\x7e" + struct.pack(">H", n) if n < 65536 else b"\x7f" + struct.pack(">Q", n)
    return bytes([0x80 | opcode]) + size + data
class Handler(socketserver.StreamRequestHandler):
    def handle(self):
        self.rfile.readline()
        headers = {}
        while line := self.rfile.readline().strip():
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("upgrade", "").lower() != "websocket":
            body = b"websocket only"
            self.wfile.write(b"HTTP/1.1 426 Upgrade Required\r\nContent-Length: %d\r\n"
                             b"Connection: close\r\n\r\n%s" % (len(body), body))
            return
        digest = hashlib.sha1((headers["sec-websocket-key"] + GUID).encode()).digest()
        accept = base64.b64encode(digest).decode()
        protocol = headers.get("sec-websocket-protocol", "").split(",")[0].strip()
        extra = f"Sec-WebSocket-Protocol: {protocol}\r\n" if protocol else ""
        self.wfile.write(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                          f"Sec-WebSocket-Accept: {accept}\r\n{extra}\r\n").encode())
        while len(head := self.rfile.read(2)) == 2:
            opcode, n = head[0] & 0x0F, head[1] & 0x7F
            if n == 126: n = struct.unpack(">H", self.rfile.read(2))[0]
            elif n == 127: n = struct.unpack(">Q", self.rfile.read(8))[0]
            mask = self.rfile.read(4) if head[1] & 0x80 else b"\0\0\0\0"
            data = self.rfile.read(n)
            key = int.from_bytes((mask * (n // 4 + 1))[:n], "big")
            data = (int.from_bytes(data, "big") ^ key).to_bytes(n, "big")
            if opcode == 8:
                self.wfile.write(frame(8, data[:2]))
                return
            self.wfile.write(frame(10 if opcode == 9 else opcode, data))
class Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
Server(("0.0.0.0", int(sys.argv[1])), Handler).serve_forever()
"""

HTTP_PORT, SSE_PORT, WS_PORT, CLOSED_PORT = 8000, 8001, 8002, 8999


class FakeResolver:
    """Maps test sandbox IDs to real VMs; anything else is unknown."""

    def __init__(self) -> None:
        self.targets: dict[str, ProxyTarget] = {}
        self.access: dict[str, SandboxAccess] = {}

    async def proxy_access(self, sandbox_id: str) -> SandboxAccess | None:
        return self.access.get(sandbox_id)

    async def proxy_target(self, sandbox_id: str, *, resume: bool) -> ProxyTarget | None:
        return self.targets.get(sandbox_id)

    def add(self, sandbox: RunningSandbox) -> None:
        self.targets[sandbox.sandbox_id] = ProxyTarget(sandbox.sandbox_id, sandbox.vm.guest.network)
        self.access[sandbox.sandbox_id] = SandboxAccess(
            sandbox.access_token, traffic_access_token=None, secure=True, public_traffic=True
        )

    def remove(self, sandbox_id: str) -> None:
        self.targets.pop(sandbox_id, None)
        self.access.pop(sandbox_id, None)


@dataclass
class ProxyServer:
    url: str
    proxy: SandboxProxy
    resolver: FakeResolver
    runner: web.AppRunner


async def _start_proxy() -> ProxyServer:
    resolver = FakeResolver()
    proxy = SandboxProxy(resolver, DOMAIN)

    @web.middleware
    async def require_api_key(request: web.Request, handler):  # stands in for the node's API auth
        if request.headers.get("X-API-Key") != "key":
            return web.Response(status=401)
        return await handler(request)

    async def node_health(request: web.Request) -> web.Response:
        return web.Response(status=204)

    app = web.Application(middlewares=[proxy.middleware(), require_api_key])
    app.router.add_get("/health", node_health)
    proxy.setup(app)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return ProxyServer(f"http://127.0.0.1:{port}", proxy, resolver, runner)


@pytest.fixture(scope="module")
def proxy_server(node_loop: NodeLoop) -> Iterator[ProxyServer]:
    server = node_loop.run(_start_proxy())
    yield server
    node_loop.run(server.runner.cleanup())


def proxied_sdk(url: str, sandbox_id: str, token: str | None):
    """The official SDK's `Sandbox` in single-URL mode, pointed at the proxy."""
    from e2b import Sandbox
    from e2b.connection_config import ConnectionConfig
    from packaging.version import Version

    from aenv.agent.envd import ENVD_VERSION

    headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(ENVD_PORT)}
    if token:
        headers["X-Access-Token"] = token
    config = ConnectionConfig(debug=True, sandbox_url=url, extra_sandbox_headers=headers)
    return Sandbox(
        sandbox_id=sandbox_id, sandbox_domain=DOMAIN, envd_version=Version(ENVD_VERSION),
        envd_access_token=token, traffic_access_token=None, connection_config=config,
    )  # fmt: skip


def wait_for_guest_port(sdk, port: int) -> None:
    probe = f"for i in $(seq 200); do curl -so /dev/null localhost:{port} && exit 0; sleep 0.1; done; exit 1"
    assert sdk.commands.run(probe).exit_code == 0


@dataclass
class Guest:
    sandbox: RunningSandbox
    sdk: Any  # proxied e2b Sandbox

    @property
    def id(self) -> str:
        return self.sandbox.sandbox_id


@pytest.fixture(scope="module")
def guest(engine, base_template, node_loop: NodeLoop, proxy_server: ProxyServer) -> Iterator[Guest]:
    """One sandbox behind the proxy, with an HTTP, an SSE and a WebSocket server in it."""
    manager = SandboxManager(engine, node_loop)
    try:
        sandbox = manager.start(base_template.id)
        proxy_server.resolver.add(sandbox)
        sdk = proxied_sdk(proxy_server.url, sandbox.sandbox_id, sandbox.access_token)
        sdk.files.write("/tmp/www/hello.txt", "hello from the guest\n")
        sdk.files.write("/tmp/sse.py", SSE_SERVER)
        sdk.files.write("/tmp/ws.py", WS_SERVER)
        servers = [
            f"python3 -m http.server {HTTP_PORT} --bind 0.0.0.0 --directory /tmp/www",
            f"python3 /tmp/sse.py {SSE_PORT}",
            f"python3 /tmp/ws.py {WS_PORT}",
        ]
        handles = [sdk.commands.run(cmd, background=True, timeout=0) for cmd in servers]
        for port in (HTTP_PORT, SSE_PORT, WS_PORT):
            wait_for_guest_port(sdk, port)
        yield Guest(sandbox, sdk)
        for handle in handles:
            handle.kill()
    finally:
        proxy_server.resolver.targets.clear()
        proxy_server.resolver.access.clear()
        # As a node does for a stopped sandbox: streams to a VM that is gone would never end.
        node_loop.loop.call_soon_threadsafe(proxy_server.proxy.close)
        manager.close()


def host_of(port: int, sandbox_id: str) -> str:
    return f"{port}-{sandbox_id}.{DOMAIN}"


# --- envd through the proxy with the official SDK ---------------------------------------------------


def test_commands_foreground_streaming_background(guest: Guest):
    sdk = guest.sdk
    result = sdk.commands.run("echo out; echo err >&2")
    assert (result.exit_code, result.stdout, result.stderr) == (0, "out\n", "err\n")

    arrivals: list[tuple[float, str]] = []
    started = time.monotonic()
    sdk.commands.run(
        "for i in 1 2 3 4; do echo line$i; sleep 0.5; done",
        on_stdout=lambda line: arrivals.append((time.monotonic() - started, line.strip())),
    )
    assert [line for _, line in arrivals] == ["line1", "line2", "line3", "line4"]
    assert arrivals[-1][0] - arrivals[0][0] > 1.0, f"output was buffered, not streamed: {arrivals}"

    handle = sdk.commands.run("sleep 1; echo background done", background=True)
    assert handle.pid in [p.pid for p in sdk.commands.list()]
    connected = sdk.commands.connect(handle.pid)
    finished = connected.wait()
    assert finished.exit_code == 0 and "background done" in finished.stdout


def test_files_large_both_ways(guest: Guest):
    sdk = guest.sdk
    data = os.urandom(20 * 1024 * 1024)
    digest = hashlib.sha256(data).hexdigest()

    sdk.files.write("/tmp/big.bin", data)  # multipart with Content-Length
    assert sdk.commands.run("sha256sum /tmp/big.bin").stdout.split()[0] == digest
    assert hashlib.sha256(sdk.files.read("/tmp/big.bin", format="bytes")).hexdigest() == digest

    chunks = (data[i : i + (1 << 20)] for i in range(0, len(data), 1 << 20))
    sdk.files.write("/tmp/big2.bin", chunks)  # iterator: octet-stream, chunked request body
    assert sdk.commands.run("sha256sum /tmp/big2.bin").stdout.split()[0] == digest
    streamed = hashlib.sha256()
    for piece in sdk.files.read("/tmp/big2.bin", format="stream"):
        streamed.update(piece)
    assert streamed.hexdigest() == digest

    sdk.files.write("/tmp/file-object.bin", io.BytesIO(data[:3_000_000]))
    assert sdk.files.read("/tmp/file-object.bin", format="bytes") == data[:3_000_000]


def test_expect_continue_upload(guest: Guest, proxy_server: ProxyServer):
    """curl-style `Expect: 100-continue`: the node answers the interim response, the guest never sees it."""
    body = os.urandom(300_000)
    head = (
        "POST /files?path=/tmp/expect.bin HTTP/1.1\r\nHost: node\r\n"
        f"E2b-Sandbox-Id: {guest.id}\r\nE2b-Sandbox-Port: {ENVD_PORT}\r\n"
        f"X-Access-Token: {guest.sandbox.access_token}\r\nContent-Type: application/octet-stream\r\n"
        f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection(httpx.URL(proxy_server.url).netloc.decode().split(":"), timeout=30) as sock:
        sock.sendall(head.encode())
        assert sock.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert b"/tmp/expect.bin" in answer
    assert guest.sdk.files.read("/tmp/expect.bin", format="bytes") == body


def test_watch_dir(guest: Guest):
    sdk = guest.sdk
    sdk.files.make_dir("/tmp/watched")
    handle = sdk.files.watch_dir("/tmp/watched")
    try:
        sdk.files.write("/tmp/watched/a.txt", "a")
        events: list[Any] = []

        def seen() -> bool:
            events.extend(handle.get_new_events())
            return any(e.name == "a.txt" for e in events)

        wait_for(seen, timeout=20)
    finally:
        handle.stop()


def test_is_running_and_health_route_to_the_sandbox(guest: Guest, proxy_server: ProxyServer):
    assert guest.sdk.is_running()
    # /health with routing headers is the sandbox's, not the node's (envd answers it, no API key needed).
    headers = {"E2b-Sandbox-Id": guest.id, "E2b-Sandbox-Port": str(ENVD_PORT)}
    assert httpx.get(f"{proxy_server.url}/health", headers=headers).status_code == 204
    assert proxied_sdk(proxy_server.url, UNKNOWN_ID, "x").is_running() is False


# --- user ports: host routing, /proxy, SSE, WebSocket -----------------------------------------------


def test_host_routing_to_guest_http_server(guest: Guest, proxy_server: ProxyServer):
    with httpx.Client(base_url=proxy_server.url) as client:
        r = client.get("/hello.txt", headers={"Host": host_of(HTTP_PORT, guest.id)})
        assert r.status_code == 200 and r.text == "hello from the guest\n"
        r = client.head("/hello.txt", headers={"Host": host_of(HTTP_PORT, guest.id)})
        assert r.status_code == 200 and r.headers["content-length"] == "21" and r.content == b""
        # AgentENV's /proxy prefix with its own header names; the prefix is stripped upstream.
        agentenv = {"x-agentenv-sandbox-id": guest.id, "x-agentenv-target-port": str(HTTP_PORT)}
        r = client.get("/proxy/hello.txt", headers=agentenv)
        assert r.status_code == 200 and r.text == "hello from the guest\n"
        r = client.get("/proxy/missing", headers=agentenv)
        assert r.status_code == 404
        # Routing headers win over the host.
        headers = {"Host": host_of(CLOSED_PORT, guest.id), "E2b-Sandbox-Id": guest.id}
        headers["E2b-Sandbox-Port"] = str(HTTP_PORT)
        assert client.get("/hello.txt", headers=headers).status_code == 200


def test_server_sent_events_stream(guest: Guest, proxy_server: ProxyServer):
    headers = {"Host": host_of(SSE_PORT, guest.id), "Accept": "text/event-stream"}
    arrivals: list[float] = []
    events: list[str] = []
    started = time.monotonic()
    with httpx.stream("GET", f"{proxy_server.url}/events?n=5", headers=headers, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                arrivals.append(time.monotonic() - started)
    assert events == [f"tick {i}" for i in range(5)]
    assert arrivals[-1] - arrivals[0] > 0.8, f"events were buffered: {arrivals}"


def test_websocket_echo(guest: Guest, proxy_server: ProxyServer, node_loop: NodeLoop):
    big = os.urandom(1 << 20)

    async def talk() -> None:
        async with ClientSession() as session:
            headers = {"Host": host_of(WS_PORT, guest.id)}
            async with session.ws_connect(
                f"{proxy_server.url}/ws", headers=headers, protocols=("echo.v1",), autoping=False
            ) as ws:
                assert ws.protocol == "echo.v1"
                for i in range(20):
                    await ws.send_str(f"message {i}")
                    assert (await ws.receive(timeout=10)).data == f"message {i}"
                await ws.send_bytes(big)
                msg = await ws.receive(timeout=30)
                assert msg.type == WSMsgType.BINARY and msg.data == big
                await ws.ping(b"are you there")
                assert (await ws.receive(timeout=10)).type == WSMsgType.PONG
                await ws.close()
            # A guest that refuses the upgrade: its answer is passed on as is.
            async with session.get(f"{proxy_server.url}/ws", headers=headers) as r:
                assert r.status == 426 and await r.text() == "websocket only"

    node_loop.run(talk(), timeout=120)


# --- errors and access control ----------------------------------------------------------------------


def test_error_bodies(guest: Guest, proxy_server: ProxyServer):
    envd = {"E2b-Sandbox-Port": str(ENVD_PORT)}
    with httpx.Client(base_url=proxy_server.url) as client:
        for path in ("/health", "/files?path=/etc/hostname", "/process.Process/List"):
            r = client.post(path, headers={**envd, "E2b-Sandbox-Id": UNKNOWN_ID}, content=b"{}")
            assert r.status_code == 502
            assert r.json() == {"sandboxId": UNKNOWN_ID, "message": "The sandbox was not found", "code": 502}
        r = client.get("/", headers={"Host": host_of(CLOSED_PORT, guest.id)})
        assert r.status_code == 502
        assert r.json() == {
            "sandboxId": guest.id,
            "message": "The sandbox is running but port is not open",
            "port": CLOSED_PORT,
            "code": 502,
        }
        for headers, fragment in [
            ({"E2b-Sandbox-Id": guest.id}, "E2b-Sandbox-Port"),
            ({"E2b-Sandbox-Port": "49983"}, "E2b-Sandbox-Id"),
            ({"E2b-Sandbox-Id": guest.id, "E2b-Sandbox-Port": "http"}, "not a TCP port"),
            ({"E2b-Sandbox-Id": guest.id, "E2b-Sandbox-Port": "70000"}, "not a TCP port"),
            ({"E2b-Sandbox-Id": "Bad/Id", "E2b-Sandbox-Port": "49983"}, "not a sandbox ID"),
            ({"Host": f"nonsense.{DOMAIN}"}, "expected <port>-<sandboxID>"),
        ]:
            r = client.get("/health", headers=headers)
            assert r.status_code == 400 and fragment in r.json()["message"], (headers, r.text)
        assert client.get("/proxy/health").status_code == 400
        # Not a data-plane request: the node's own routes and its API-key check apply.
        assert client.get("/health").status_code == 401
        assert client.get("/health", headers={"X-API-Key": "key"}).status_code == 204


def test_envd_internal_routes_refused(guest: Guest, proxy_server: ProxyServer):
    headers = {"E2b-Sandbox-Id": guest.id, "E2b-Sandbox-Port": str(ENVD_PORT)}
    headers["X-Access-Token"] = guest.sandbox.access_token
    with httpx.Client(base_url=proxy_server.url, headers=headers) as client:
        internal = ["/init", "//init", "/init/", "/%69nit", "/files/../init", "/./init?x=1", "/freeze"]
        for method, path in [("GET", "/init"), *(("POST", p) for p in internal)]:
            url = httpx.URL(proxy_server.url).copy_with(raw_path=path.encode())  # exactly as written
            r = client.request(method, url, content=json.dumps({"accessToken": "stolen"}))
            assert r.status_code == 404 and r.json()["code"] == 404, (method, path, r.text)
        # The sandbox's real token still works: /init never reached envd.
        assert guest.sdk.commands.run("true").exit_code == 0


def test_access_tokens(guest: Guest, proxy_server: ProxyServer):
    envd = {"E2b-Sandbox-Id": guest.id, "E2b-Sandbox-Port": str(ENVD_PORT)}
    rpc = {"Content-Type": "application/json", "Connect-Protocol-Version": "1"}
    with httpx.Client(base_url=proxy_server.url) as client:
        r = client.post("/process.Process/List", headers={**envd, **rpc}, content=b"{}")
        assert r.status_code == 401 and "access token" in r.json()["message"]
        wrong = {**envd, **rpc, "X-Access-Token": "wrong"}
        r = client.post("/process.Process/List", headers=wrong, content=b"{}")
        assert r.status_code == 401
        assert client.get("/health", headers=envd).status_code == 204  # envd's unauthenticated path

        access = proxy_server.resolver.access[guest.id]
        proxy_server.resolver.access[guest.id] = replace(
            access, public_traffic=False, traffic_access_token=TRAFFIC_TOKEN
        )
        try:
            host = {"Host": host_of(HTTP_PORT, guest.id)}
            r = client.get("/hello.txt", headers=host)
            assert r.status_code == 403 and "is missing" in r.json()["message"]
            r = client.get("/hello.txt", headers={**host, "E2B-Traffic-Access-Token": "wrong"})
            assert r.status_code == 403 and "is invalid" in r.json()["message"]
            r = client.get("/hello.txt", headers={**host, "E2B-Traffic-Access-Token": TRAFFIC_TOKEN})
            assert r.status_code == 200
            assert guest.sdk.commands.run("true").exit_code == 0  # the envd port needs no traffic token
        finally:
            proxy_server.resolver.access[guest.id] = access


def test_latency_direct_vs_proxy(guest: Guest, proxy_server: ProxyServer):
    direct = guest.sandbox.sdk()

    def median_ms(sdk, rounds: int = 30) -> float:
        sdk.commands.run("true")  # warm connections up
        samples = []
        for _ in range(rounds):
            started = time.perf_counter()
            sdk.commands.run("true")
            samples.append((time.perf_counter() - started) * 1000)
        return statistics.median(samples)

    direct_ms, proxied_ms = median_ms(direct), median_ms(guest.sdk)
    print(f"\ncommands.run('true') median: direct {direct_ms:.1f} ms, via proxy {proxied_ms:.1f} ms "
          f"({proxied_ms / direct_ms:.2f}x)")  # fmt: skip

    def health_ms(url: str, headers: dict[str, str], rounds: int = 100) -> float:
        with httpx.Client(base_url=url, headers=headers) as client:
            client.get("/health")
            samples = []
            for _ in range(rounds):
                started = time.perf_counter()
                assert client.get("/health").status_code == 204
                samples.append((time.perf_counter() - started) * 1000)
        return statistics.median(samples)

    routing = {"E2b-Sandbox-Id": guest.id, "E2b-Sandbox-Port": str(ENVD_PORT)}
    direct_ms, proxied_ms = health_ms(guest.sandbox.envd_url, {}), health_ms(proxy_server.url, routing)
    print(f"GET /health median: direct {direct_ms:.2f} ms, via proxy {proxied_ms:.2f} ms "
          f"({proxied_ms / direct_ms:.2f}x)")  # fmt: skip


def test_release_ends_in_flight_streams(
    base_template, sandboxes: SandboxManager, proxy_server: ProxyServer, node_loop: NodeLoop
):
    """A sandbox killed mid-stream: the proxy's clients see the end of the stream, not a hang."""
    sandbox = sandboxes.start(base_template.id)
    proxy_server.resolver.add(sandbox)
    try:
        sdk = proxied_sdk(proxy_server.url, sandbox.sandbox_id, sandbox.access_token)
        sdk.files.write("/tmp/sse.py", SSE_SERVER)
        sdk.commands.run(f"python3 /tmp/sse.py {SSE_PORT}", background=True, timeout=0)
        wait_for_guest_port(sdk, SSE_PORT)
        command = sdk.commands.run("while :; do echo tick; sleep 0.2; done", background=True, timeout=0)

        outcome: dict[str, Any] = {}

        def consume_events() -> None:
            headers = {"Host": host_of(SSE_PORT, sandbox.sandbox_id)}
            try:
                with httpx.stream("GET", f"{proxy_server.url}/?n=-1", headers=headers, timeout=30) as r:
                    for _ in r.iter_lines():
                        outcome["events"] = outcome.get("events", 0) + 1
                outcome["sse"] = "ended"
            except httpx.HTTPError as exc:
                outcome["sse"] = type(exc).__name__

        def consume_command() -> None:
            try:
                command.wait()
                outcome["command"] = "ended"
            except Exception as exc:
                outcome["command"] = type(exc).__name__

        threads = [threading.Thread(target=consume_events), threading.Thread(target=consume_command)]
        for thread in threads:
            thread.start()
        wait_for(lambda: outcome.get("events", 0) > 3, timeout=20)

        proxy_server.resolver.remove(sandbox.sandbox_id)
        sandboxes.kill(sandbox.sandbox_id)
        started = time.monotonic()
        node_loop.loop.call_soon_threadsafe(proxy_server.proxy.release, sandbox.sandbox_id)
        for thread in threads:
            thread.join(15)
        assert not any(t.is_alive() for t in threads), f"streams still open: {outcome}"
        # Cut short, not completed: neither stream may look like it ended normally.
        assert outcome["sse"] != "ended" and outcome["command"] != "ended", outcome
        print(f"\nstreams ended {time.monotonic() - started:.2f} s after the kill: {outcome}")
        assert sdk.is_running() is False
    finally:
        proxy_server.resolver.remove(sandbox.sandbox_id)


@pytest.fixture(autouse=True)
def _no_leaked_loop_tasks(node_loop: NodeLoop):
    """Proxy tasks (body senders, tunnels) must not outlive their requests."""
    yield

    async def leftover() -> list[asyncio.Task]:
        await asyncio.sleep(0.2)
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        return [t for t in tasks if "sandboxproxy" in repr(t.get_coro()).lower()]

    assert node_loop.run(leftover()) == []
