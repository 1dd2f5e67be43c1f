"""SandboxFusion's HTTP API on nodes and gateways: `POST /fusion/<token>/run_code`.

verl's `sandbox_fusion` tool and the `sandbox-fusion` client post `{endpoint}/run_code` and send
no credentials, so the secret rides in the endpoint: `<node or gateway URL>/fusion/<token>`, with
`<token>` the setting `fusion_token` (`AENV_FUSION_TOKEN`). While it is unset, and for any other
token, every request answers the router's own 404, so a caller learns nothing from a wrong token;
tokens are compared in constant time and never logged (the servers keep no access log, and
nothing here logs a path).

Each request runs alone in a fresh sandbox of `fusion_template` (`base` by default; the node's
warm pool makes the create a restore): create, write the files, compile, run, fetch the files,
kill. The sandbox is reached through the server's own data plane (`E2b-Sandbox-Id` routing to
envd), the path every SDK takes, so a gateway serves the API exactly as a node does: it creates
the sandbox on a node through its `NodeService` and its proxy forwards envd's traffic there.

Limits: the run timeout ends the wait and reports SandboxFusion's `TimeLimitExceeded` (the
program dies with its sandbox); a `memory_limit_MB` becomes the program's `ulimit -v`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import json
import logging
import posixpath
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
from aiohttp import web
from pydantic import BaseModel, Field

from ..agent.envd import ENVD_PORT
from ..agent.envd.framing import FLAG_END_STREAM, envelope, envelopes
from ..cluster.auth import CLUSTER_SECRET_HEADER
from ..config import Settings
from ..orchestrator.errors import InvalidRequest, SandboxError
from ..orchestrator.interface import CreateRequest, NodeService
from .proxy import ACCESS_TOKEN_HEADER

log = logging.getLogger(__name__)

Parse = Callable[[web.Request, type[BaseModel]], Awaitable[Any]]
WORKDIR = "/tmp/fusion"  # the program's working directory; relative file paths are under it
STDIN_FILE = ".stdin"
MAX_STREAM = 8 << 20  # bytes of stdout and of stderr kept per phase; the rest is dropped
CONNECT_TIMEOUT = 30.0  # seconds to connect to this server's own listener
SANDBOX_GRACE = 60  # seconds a sandbox outlives its request's timeouts, should its kill be lost
MISSING = "aenv-fusion: no program "  # what a phase's check says when the template lacks its tool
# SandboxFusion's languages (its client's `Language`): others are bad requests.
FUSION_LANGUAGES = frozenset(
    ["python", "python2", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript",
     "sql", "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit",
     "kotlin_script", "jest", "verilog", "python_gpu", "lean", "swift", "racket", "gtest", "react"]
)  # fmt: skip


@dataclass(frozen=True)
class Runtime:
    """How a language runs: the file its code goes to, an optional compile step, the run."""

    source: str
    run: str
    compile: str | None = None


# The languages aenv runs, where the template has their tools; the others answer SandboxError.
RUNTIMES = {
    "python": Runtime("main.py", "python3 main.py"),
    "bash": Runtime("main.sh", "bash main.sh"),
    "nodejs": Runtime("main.js", "node main.js"),
    "typescript": Runtime("main.ts", "tsx main.ts"),
    "cpp": Runtime("main.cpp", "./main", "g++ -std=c++17 -O2 -o main main.cpp"),
    "go": Runtime("main.go", "./main", "go build -o main main.go"),
    "rust": Runtime("main.rs", "./main", "rustc -O -o main main.rs"),
    "java": Runtime("Main.java", "java Main", "javac Main.java"),
    "php": Runtime("main.php", "php main.php"),
    "lua": Runtime("main.lua", "lua main.lua"),
    "R": Runtime("main.R", "Rscript main.R"),
    "perl": Runtime("main.pl", "perl main.pl"),
    "ruby": Runtime("main.rb", "ruby main.rb"),
    "julia": Runtime("main.jl", "julia main.jl"),
}


class RunCodeRequest(BaseModel):
    """SandboxFusion's `RunCodeRequest`, and verl's `memory_limit_MB`; other fields are ignored."""

    code: str
    language: str
    compile_timeout: float = Field(10, gt=0, le=3600)
    run_timeout: float = Field(10, gt=0, le=3600)
    memory_limit_MB: int | None = None  # the wire's name
    stdin: str | None = None
    files: dict[str, str | None] = {}
    fetch_files: list[str] = []


@dataclass(frozen=True)
class Phase:
    """A command's outcome as SandboxFusion reports it (`CommandRunResult`)."""

    status: str  # Finished | TimeLimitExceeded
    execution_time: float
    return_code: int | None
    stdout: bytes
    stderr: bytes

    def wire(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "execution_time": round(self.execution_time, 6),
            "cpu_time": None,
            "return_code": self.return_code,
            "stdout": self.stdout.decode(errors="replace"),
            "stderr": self.stderr.decode(errors="replace"),
        }

    @property
    def ok(self) -> bool:
        return self.status == "Finished" and self.return_code == 0


class Unsupported(Exception):
    """The language cannot run in the configured template."""


def local_url(addr: str) -> str:
    """The base URL this process reaches its own `host:port` listener at."""
    host, _, port = addr.rpartition(":")
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]", "[::]": "[::1]"}.get(host, host)
    return f"http://{host}:{port}"


def phase_script(command: str, stdin: str, memory_mib: int | None) -> str:
    """The shell script of one phase: check its program is there, apply the limit, exec it."""
    tool = command.split()[0]
    check = "" if tool.startswith("./") else (
        f"command -v {tool} >/dev/null 2>&1 || {{ printf '%s' '{MISSING}{tool}' >&2; exit 127; }}; "
    )  # fmt: skip
    limit = f"ulimit -v {memory_mib * 1024}; " if memory_mib and memory_mib > 0 else ""
    return f"{check}{limit}exec {command} < {stdin}"


def decoded_files(files: dict[str, str | None]) -> dict[str, bytes]:
    """The request's files by absolute path in the guest (relative ones under WORKDIR)."""
    decoded = {}
    for name, content in files.items():
        if content is None:
            continue
        try:
            decoded[posixpath.join(WORKDIR, name)] = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidRequest(f"files[{name!r}] is not base64: {exc}") from None
    return decoded


class GuestSession:
    """envd of one sandbox, through the server's own data plane."""

    def __init__(self, http: aiohttp.ClientSession, base: str, headers: dict[str, str]):
        self.http = http
        self.base = base
        self.headers = headers

    async def upload(self, files: dict[str, bytes]) -> None:
        """All files in one multipart request, each part named by its full path (as E2B's SDKs)."""
        with aiohttp.MultipartWriter("form-data") as form:
            for path, data in files.items():
                part = form.append(data, {"Content-Type": "application/octet-stream"})
                part.set_content_disposition("form-data", quote_fields=False, name="file", filename=path)
        async with self.http.post(f"{self.base}/files", data=form, headers=self.headers) as answer:
            if answer.status >= 300:
                raise RuntimeError(f"envd refused the files: {answer.status} {(await answer.text())[:200]}")

    async def download(self, path: str) -> bytes | None:
        url = f"{self.base}/files?path={quote(posixpath.join(WORKDIR, path))}"
        async with self.http.get(url, headers=self.headers) as answer:
            return await answer.read() if answer.status == 200 else None

    async def execute(self, script: str, timeout: float) -> Phase:
        """Run `script` with /bin/sh in WORKDIR as the template's user; at `timeout` stop waiting."""
        process = {"cmd": "/bin/sh", "args": ["-c", script], "envs": {}, "cwd": WORKDIR}
        headers = self.headers | {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}
        body = envelope(json.dumps({"process": process}).encode())
        output = {"stdout": bytearray(), "stderr": bytearray()}
        started = time.monotonic()
        async with self.http.post(f"{self.base}/process.Process/Start", data=body, headers=headers) as answer:
            if answer.status != 200:
                raise RuntimeError(f"envd refused the command: {answer.status} {(await answer.text())[:200]}")
            try:
                async with asyncio.timeout(timeout):
                    code = await self._follow(envelopes(answer.content.iter_any()), output)
                status, elapsed = "Finished", time.monotonic() - started
            except TimeoutError:
                status, elapsed, code = "TimeLimitExceeded", timeout, None
        return Phase(status, elapsed, code, bytes(output["stdout"]), bytes(output["stderr"]))

    @staticmethod
    async def _follow(frames: Any, output: dict[str, bytearray]) -> int:
        async for flags, frame in frames:
            if flags & FLAG_END_STREAM:
                raise RuntimeError(f"envd ended the command: {frame.get('error') or 'without an exit code'}")
            event = frame.get("event", {})
            for stream, chunk in event.get("data", {}).items():
                kept = output.get(stream)
                if kept is not None and len(kept) < MAX_STREAM:
                    kept += base64.b64decode(chunk)[: MAX_STREAM - len(kept)]
            if "end" in event:
                return int(event["end"].get("exitCode", 0))
        raise RuntimeError("envd's answer ended before the command did")


class Fusion:
    """The SandboxFusion routes of one server (a node or a gateway)."""

    def __init__(self, token: str | None, template: str, base_url: str, cluster_secret: str | None = None):
        self.token = token
        self.template = template
        self.base_url = base_url  # this server's own listener: its data plane reaches envd
        self.cluster_secret = cluster_secret  # a node in a cluster takes its own traffic only with it
        self.node: NodeService | None = None
        self.parse: Parse | None = None
        self._http: aiohttp.ClientSession | None = None
        self._kills: set[asyncio.Task[None]] = set()

    @classmethod
    def of(cls, settings: Settings, addr: str, cluster_secret: str | None = None) -> Fusion:
        return cls(settings.fusion_token or None, settings.fusion_template, local_url(addr), cluster_secret)

    def mount(self, app: web.Application, node: NodeService, parse: Parse) -> None:
        """Add the routes (always: with the API off they answer 404, as an unknown route does)."""
        self.node, self.parse = node, parse
        app.router.add_route("POST", "/fusion/{token}/run_code", self.run_code)
        app.on_cleanup.append(self._close)

    async def _close(self, app: web.Application) -> None:
        await asyncio.gather(*self._kills, return_exceptions=True)
        if self._http is not None:
            await self._http.close()

    def _admit(self, request: web.Request) -> None:
        presented = request.match_info["token"].encode()
        if self.token is None or not hmac.compare_digest(presented, self.token.encode()):
            raise web.HTTPNotFound()

    async def run_code(self, request: web.Request) -> web.Response:
        self._admit(request)
        assert self.parse is not None
        body: RunCodeRequest = await self.parse(request, RunCodeRequest)
        if body.language not in FUSION_LANGUAGES:
            raise InvalidRequest(f"unknown language {body.language!r}: one of SandboxFusion's languages")
        files = decoded_files(body.files)
        runtime = RUNTIMES.get(body.language)
        if runtime is None:
            return web.json_response(sandbox_error(f"aenv does not run {body.language} code"))
        try:
            return web.json_response(await self._run(body, runtime, files))
        except Unsupported as exc:
            return web.json_response(sandbox_error(str(exc)))
        except (SandboxError, aiohttp.ClientError, RuntimeError, TimeoutError, OSError) as exc:
            log.warning("a SandboxFusion run failed: %s", exc)
            return web.json_response(sandbox_error(f"the sandbox failed: {exc}"))
        except Exception:  # a bug: logged here, as the errors middleware would log the path (the token)
            log.exception("a SandboxFusion run failed")
            return web.json_response(sandbox_error("internal error: see the server's log"))

    async def _run(self, body: RunCodeRequest, runtime: Runtime, files: dict[str, bytes]) -> dict[str, Any]:
        assert self.node is not None
        files[posixpath.join(WORKDIR, runtime.source)] = body.code.encode()
        stdin = "/dev/null"
        if body.stdin is not None:
            stdin = STDIN_FILE
            files[posixpath.join(WORKDIR, STDIN_FILE)] = body.stdin.encode()
        ttl = int(body.compile_timeout + body.run_timeout) + SANDBOX_GRACE
        record = await self.node.create(
            CreateRequest(template=self.template, timeout=ttl, metadata={"aenv.fusion": "run_code"})
        )
        try:
            guest = self._guest(record.sandbox_id, record.envd_token)
            await guest.upload(files)
            compiled = None
            if runtime.compile is not None:
                script = phase_script(runtime.compile, stdin, None)
                compiled = await guest.execute(script, body.compile_timeout)
                self._check_tool(compiled, body.language)
            ran = None
            if compiled is None or compiled.ok:
                script = phase_script(runtime.run, stdin, body.memory_limit_MB)
                ran = await guest.execute(script, body.run_timeout)
                self._check_tool(ran, body.language)
            fetched = await asyncio.gather(*(guest.download(path) for path in body.fetch_files))
        finally:
            self._kill_later(record.sandbox_id)
        succeeded = ran is not None and ran.ok
        return {
            "status": "Success" if succeeded else "Failed",
            "message": "",
            "compile_result": compiled.wire() if compiled else None,
            "run_result": ran.wire() if ran else None,
            "executor_pod_name": record.sandbox_id,
            "files": {
                path: base64.b64encode(data).decode()
                for path, data in zip(body.fetch_files, fetched, strict=True)
                if data is not None
            },
        }

    def _check_tool(self, phase: Phase, language: str) -> None:
        if phase.return_code == 127 and phase.stderr.startswith(MISSING.encode()):
            tool = phase.stderr[len(MISSING) :].decode(errors="replace")
            raise Unsupported(f"template {self.template!r} has no {tool} to run {language} code")

    def _guest(self, sandbox_id: str, envd_token: str | None) -> GuestSession:
        if self._http is None:  # made on the serving loop, at the first request
            # No overall deadline (aiohttp's default is 5 min): a run's own timeout bounds it.
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT)
            self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)
        headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(ENVD_PORT)}
        if envd_token:
            headers[ACCESS_TOKEN_HEADER] = envd_token
        if self.cluster_secret:
            headers[CLUSTER_SECRET_HEADER] = self.cluster_secret
        return GuestSession(self._http, self.base_url, headers)

    def _kill_later(self, sandbox_id: str) -> None:
        """Kill after the answer is sent: the caller does not wait for it (its TTL backs it up)."""
        assert self.node is not None
        node = self.node

        async def kill() -> None:
            with contextlib.suppress(SandboxError):
                await node.kill(sandbox_id)

        task = asyncio.create_task(kill())
        self._kills.add(task)
        task.add_done_callback(self._kills.discard)


Fusion.run_code.presigned = True  # type: ignore[attr-defined]  # the token is the credential, not the API key


def sandbox_error(message: str) -> dict[str, Any]:
    """SandboxFusion's answer for a failure on the sandbox's side (its client raises it)."""
    return {"status": "SandboxError", "message": message, "run_result": None, "files": {}}
