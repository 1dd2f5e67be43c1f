"""EnvdLink without a guest: init's retries against a script of outcomes, its connections
against a loopback server."""

from __future__ import annotations

import asyncio
import socket

import pytest

from aenv.vmm import envd_link
from aenv.vmm.envd_link import EnvdLink


class ScriptedLink(EnvdLink):
    def __init__(self, outcomes: list[BaseException | tuple[int, bytes]]):
        super().__init__(network=None)  # type: ignore[arg-type]
        self.outcomes = outcomes
        self.timestamps: list[str] = []

    async def _request(self, method, path, *, body=b"", headers=None, timeout=5.0):
        import json

        self.timestamps.append(json.loads(body)["timestamp"])
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def test_init_retries_an_unreachable_guest_with_a_fresh_clock() -> None:
    link = ScriptedLink([OSError(113, "No route to host"), ConnectionRefusedError(), (204, b"")])
    asyncio.run(link.init({"timestamp": "2000-01-01T00:00:00Z"}, timeout=5))
    assert len(link.timestamps) == 3 and "2000-01-01T00:00:00Z" not in link.timestamps
    assert link.timestamps == sorted(link.timestamps)


def test_init_does_not_retry_past_its_timeout_or_a_timed_out_request() -> None:
    with pytest.raises(TimeoutError):
        asyncio.run(ScriptedLink([TimeoutError(), (204, b"")]).init({"timestamp": "x"}, timeout=5))
    with pytest.raises(ConnectionRefusedError):
        asyncio.run(ScriptedLink([ConnectionRefusedError()] * 100).init({"timestamp": "x"}, timeout=0.2))
    with pytest.raises(RuntimeError, match="answered 401"):
        asyncio.run(ScriptedLink([(401, b"no")]).init({"timestamp": "x"}, timeout=5))


class LoopbackNetwork:
    """A sandbox network whose sockets are plain loopback ones (the guest's address patched)."""

    def socket(self) -> socket.socket:
        sock = socket.socket()
        sock.setblocking(False)
        return sock


def test_a_kept_alive_connection_envd_closed_is_replaced(monkeypatch) -> None:
    """Requests reuse one connection; once envd closes it, the next request opens a new one."""
    answered: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = len(answered)
        answered.append(0)
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            answered[connection] += 1
            if answered[connection] == 2:  # as envd drops an idle connection
                writer.close()
                return

    async def scenario() -> list[int]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        monkeypatch.setattr(envd_link, "GUEST_ADDRESS", "127.0.0.1")
        monkeypatch.setattr(envd_link, "ENVD_PORT", server.sockets[0].getsockname()[1])
        link = EnvdLink(LoopbackNetwork())  # type: ignore[arg-type]
        try:
            return [(await link._request("GET", "/health"))[0] for _ in range(4)]
        finally:
            link.close()
            server.close()

    assert asyncio.run(scenario()) == [204] * 4
    assert answered == [2, 2]


def test_init_retries_a_connection_closed_before_its_answer(monkeypatch) -> None:
    """A guest that drops the connection unanswered (its envd restarting) is asked again."""
    connections: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(await reader.readuntil(b"\r\n\r\n"))
        if len(connections) > 1:
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            await writer.drain()
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        monkeypatch.setattr(envd_link, "GUEST_ADDRESS", "127.0.0.1")
        monkeypatch.setattr(envd_link, "ENVD_PORT", server.sockets[0].getsockname()[1])
        try:
            await EnvdLink(LoopbackNetwork()).init({"envVars": {}}, timeout=5)  # type: ignore[arg-type]
        finally:
            server.close()

    asyncio.run(scenario())
    assert len(connections) == 2 and all(c.startswith(b"POST /init HTTP/1.1\r\n") for c in connections)


def test_write_file_uploads_a_form_as_the_sdks_do(monkeypatch) -> None:
    """`form`: the multipart body E2B's SDKs send, with the path in the query; no user: no
    `username`, so envd writes as its default user. Otherwise the raw body, as root."""
    from aiohttp import web

    seen: list[tuple[str, dict[str, str], bytes]] = []

    async def upload(request: web.Request) -> web.Response:
        if request.content_type != "multipart/form-data":
            seen.append((request.content_type, dict(request.query), await request.read()))
        else:
            field = (await request.post())["file"]
            assert isinstance(field, web.FileField)
            seen.append((field.filename, dict(request.query), field.file.read()))
        return web.json_response([{"path": request.query["path"]}])

    async def scenario() -> None:
        app = web.Application()
        app.router.add_post("/files", upload)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        monkeypatch.setattr(envd_link, "GUEST_ADDRESS", "127.0.0.1")
        monkeypatch.setattr(envd_link, "ENVD_PORT", runner.addresses[0][1])
        link = EnvdLink(LoopbackNetwork())  # type: ignore[arg-type]
        try:
            await link.write_file("/tmp/a b", b"data\n", user=None, form=True, timeout=5)
            await link.write_file("/tmp/c", b"raw", timeout=5)
        finally:
            link.close()
            await runner.cleanup()

    asyncio.run(scenario())
    assert seen == [
        ("a%20b", {"path": "/tmp/a b"}, b"data\n"),  # aiohttp quotes the name; envd takes the query's path
        ("application/octet-stream", {"path": "/tmp/c", "username": "root"}, b"raw"),
    ]


# -- a hostile envd: every answer is bounded in size and time ----------------------------------

CHUNK = b"x" * 65536
ROGUE_SECONDS = 30  # a scenario that runs longer has hung on the guest: the bound did not hold


async def endless_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A 200 answer whose chunked body never ends (as a guest's root can answer on envd's port)."""
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    while True:
        writer.write(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
        await writer.drain()


async def huge_declared(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A body declared 1.5 GiB long, sent as fast as it is read."""
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (3 << 29))
    while True:
        writer.write(CHUNK)
        await writer.drain()


async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Headers at once, then a byte of body now and then, forever."""
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    while True:
        writer.write(b"1\r\n\x00\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)


async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read()  # until the node gives up


async def not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
    await writer.drain()


async def huge_frame(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A Connect stream whose first envelope announces a 4 GiB message."""
    await reader.readuntil(b"\r\n\r\n")
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/connect+json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    writer.write(b"5\r\n\x00\xff\xff\xff\xff\r\n")
    while True:
        writer.write(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
        await writer.drain()


def against(monkeypatch, serve, call):
    """`call(link)` against a loopback envd that answers with `serve`; the exception it raised."""

    async def scenario() -> BaseException | None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        monkeypatch.setattr(envd_link, "GUEST_ADDRESS", "127.0.0.1")
        monkeypatch.setattr(envd_link, "ENVD_PORT", server.sockets[0].getsockname()[1])
        link = EnvdLink(LoopbackNetwork())  # type: ignore[arg-type]
        try:
            async with asyncio.timeout(ROGUE_SECONDS):
                await call(link)
        except Exception as exc:
            return exc
        finally:
            link.close()
            server.close()
        return None

    return asyncio.run(scenario())


@pytest.mark.parametrize("serve", [endless_chunked, huge_declared])
def test_an_endless_or_huge_answer_is_refused_at_its_bound(monkeypatch, serve) -> None:
    error = against(monkeypatch, serve, lambda link: link.metrics_history(timeout=5))
    assert isinstance(error, envd_link.AnswerTooLarge) and error.code == "guest_answer_too_large"
    error = against(monkeypatch, serve, lambda link: link.init({"envVars": {}}, timeout=5))
    assert isinstance(error, envd_link.AnswerTooLarge)


def test_a_trickling_answer_ends_at_the_calls_deadline(monkeypatch) -> None:
    """Each byte comes well within the per-read timeout; the call's total deadline ends it."""
    monkeypatch.setattr(envd_link, "STREAM_GRACE", 0.5)
    error = against(monkeypatch, trickle, lambda link: link.metrics_history(timeout=1))
    assert isinstance(error, envd_link.AnswerTooSlow) and error.code == "guest_answer_too_slow"
    error = against(monkeypatch, trickle, lambda link: link.run("true", timeout=1))
    assert isinstance(error, envd_link.AnswerTooSlow)


def test_a_guest_that_sends_nothing_is_a_plain_timeout(monkeypatch) -> None:
    """A starved guest does that too: not the guest's fault, a retryable timeout as before."""
    error = against(monkeypatch, silent, lambda link: link.metrics_history(timeout=0.5))
    assert isinstance(error, TimeoutError) and not isinstance(error, envd_link.GuestAnswerError)


def test_an_answer_that_is_not_http_is_invalid(monkeypatch) -> None:
    error = against(monkeypatch, not_http, lambda link: link.metrics_history(timeout=5))
    assert isinstance(error, envd_link.AnswerInvalid) and error.code == "guest_answer_invalid"


def test_a_command_stream_frame_beyond_its_bound_is_refused(monkeypatch) -> None:
    error = against(monkeypatch, huge_frame, lambda link: link.run("true", timeout=5))
    assert isinstance(error, envd_link.AnswerTooLarge)


def test_samples_keep_their_time_and_numbers_only(monkeypatch) -> None:
    """What a hostile guest adds to its samples is not kept (they are saved with the sandbox)."""
    body = b'{"samples": [{"ts": 5, "cpu_used_pct": 1.5, "mem_used": 7, "junk": "' + b"j" * 1000 + b'"},'
    body += b' {"ts": "6"}, {"ts": 7, "disk_used": [1, 2]}, 8], "next_in": 2}'

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()

    batches = []

    async def history(link: EnvdLink) -> None:
        batches.append(await link.metrics_history())

    assert against(monkeypatch, answer, history) is None
    assert batches == [envd_link.SampleBatch([{"ts": 5, "cpu_used_pct": 1.5, "mem_used": 7}, {"ts": 7}], 2.0)]
