"""A real local OCI registry (Debian's docker-registry) for the image tests, with its auth variants.

Each registry runs on a free loopback port with its own config and storage under the test's
temporary directory and is stopped by its pid when the fixture ends, also on failure. Basic
auth uses an htpasswd file; bearer auth uses a tiny token service started here that signs
RS256 JWTs with a throwaway certificate (via ``openssl``) that the registry is told to trust.
Images are pushed with skopeo from OCI layouts the tests write themselves.
"""

from __future__ import annotations

import base64
import contextlib
import json
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
import pytest

from tests.envd.conftest import free_port

USER, PASSWORD = "builder", "s3cret-pass"
SERVICE, ISSUER = "aenv-test-registry", "aenv-test-tokens"
STARTUP_SECONDS = 30


@dataclass
class Registry:
    host: str  # 127.0.0.1:port
    workdir: Path
    credentials: tuple[str, str] | None = None

    def push(
        self, layout: Path, tag: str, repository: str, *, all_platforms: bool = False, docker: bool = False
    ) -> None:
        """Copy ``layout:tag`` to ``repository`` here with skopeo (as Docker schema 2 if ``docker``)."""
        args = ["--dest-tls-verify=false"]
        if self.credentials:
            args += ["--dest-creds", ":".join(self.credentials)]
        if all_platforms:
            args.append("--all")
        if docker:
            args += ["--format", "v2s2"]
        self._skopeo(*args, f"oci:{layout}:{tag}", f"docker://{self.host}/{repository}")

    def copy_out(self, repository: str, destination: str) -> None:
        """Copy ``repository`` from here to a skopeo destination (``oci:...``, ``docker-archive:...``)."""
        args = ["--src-tls-verify=false"]
        if self.credentials:
            args += ["--src-creds", ":".join(self.credentials)]
        self._skopeo(*args, f"docker://{self.host}/{repository}", destination)

    def _skopeo(self, *args: str) -> None:
        policy = self.workdir / "policy.json"  # accept unsigned images, whatever /etc/containers says
        policy.write_text('{"default": [{"type": "insecureAcceptAnything"}]}')
        cmd = ["skopeo", "--policy", str(policy), "copy", "--quiet", *args]
        subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL, timeout=300)


@contextlib.contextmanager
def run_registry(
    workdir: Path, auth: dict | None = None, credentials: tuple[str, str] | None = None
) -> Iterator[Registry]:
    """Start docker-registry on a free loopback port; stop it (by pid) when the block ends."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = {
        "version": "0.1",
        "log": {"level": "warn"},
        "storage": {"filesystem": {"rootdirectory": str(workdir / "storage")}, "delete": {"enabled": True}},
        "http": {"addr": f"127.0.0.1:{port}", "secret": uuid.uuid4().hex},
    }
    if auth:
        config["auth"] = auth
    config_path = workdir / "config.yml"
    config_path.write_text(json.dumps(config))  # JSON is YAML
    log = open(workdir / "registry.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(["docker-registry", "serve", str(config_path)], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v2/").status_code in (200, 401):
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"docker-registry did not start: {(workdir / 'registry.log').read_text()}")
            time.sleep(0.1)
        yield Registry(f"127.0.0.1:{port}", workdir, credentials)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextlib.contextmanager
def serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[int]:
    """Run an HTTP handler on a loopback port in a thread; yields the port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenIssuer:
    """Signs registry JWTs (RS256, x5c header) with a self-signed certificate made by openssl."""

    def __init__(self, workdir: Path):
        self.key, self.cert = workdir / "token.key", workdir / "token.pem"
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=aenv-test-tokens",
                "-keyout",
                str(self.key),
                "-out",
                str(self.cert),
            ],
            check=True,
            capture_output=True,
        )
        der = subprocess.run(
            ["openssl", "x509", "-in", str(self.cert), "-outform", "DER"], check=True, capture_output=True
        )
        self.x5c = base64.b64encode(der.stdout).decode()

    def token(self, access: list[dict]) -> str:
        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self.x5c]}
        claims = {
            "iss": ISSUER,
            "sub": USER,
            "aud": SERVICE,
            "exp": now + 600,
            "nbf": now - 60,
            "iat": now,
            "jti": uuid.uuid4().hex,
            "access": access,
        }
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        signature = subprocess.run(
            ["openssl", "dgst", "-sha256", "-sign", str(self.key)],
            input=signing_input.encode(),
            check=True,
            capture_output=True,
        ).stdout
        return f"{signing_input}.{_b64url(signature)}"


def token_handler(issuer: TokenIssuer, requests: list[dict]) -> type[BaseHTTPRequestHandler]:
    """Docker's token protocol: valid basic credentials get the scopes asked for, anonymous none."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            query = parse_qs(urlparse(self.path).query)
            requests.append(query)
            given = self.headers.get("Authorization")
            access = []
            if given:
                if given != "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode():
                    self._answer(401, {"details": "bad credentials"})
                    return
                for scope in query.get("scope", []):
                    kind, name, actions = scope.split(":")
                    access.append({"type": kind, "name": name, "actions": actions.split(",")})
            token = issuer.token(access)
            self._answer(200, {"token": token, "access_token": token, "expires_in": 600})

        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with run_registry(tmp_path_factory.mktemp("registry")) as running:
        yield running


@pytest.fixture(scope="module")
def basic_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    workdir = tmp_path_factory.mktemp("basic-registry")
    htpasswd = subprocess.run(
        ["htpasswd", "-Bbn", USER, PASSWORD], check=True, capture_output=True, text=True
    )
    (workdir / "htpasswd").write_text(htpasswd.stdout)
    auth = {"htpasswd": {"realm": "aenv-test", "path": str(workdir / "htpasswd")}}
    with run_registry(workdir, auth, (USER, PASSWORD)) as running:
        yield running


@dataclass
class TokenRegistry(Registry):
    token_requests: list[dict] | None = None


@pytest.fixture(scope="module")
def token_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TokenRegistry]:
    workdir = tmp_path_factory.mktemp("token-registry")
    requests: list[dict] = []
    with serve(token_handler(TokenIssuer(workdir), requests)) as port:
        auth = {
            "token": {
                "realm": f"http://127.0.0.1:{port}/token",
                "service": SERVICE,
                "issuer": ISSUER,
                "rootcertbundle": str(workdir / "token.pem"),
            }
        }
        with run_registry(workdir, auth, (USER, PASSWORD)) as running:
            yield TokenRegistry(running.host, running.workdir, running.credentials, requests)


@dataclass
class Proxy:
    """A loopback front of a registry that can lie: ``tamper`` rewrites (path, headers, body)."""

    host: str
    paths: list[str]
    tamper: Callable[[str, dict[str, str], bytes], tuple[int, dict[str, str], bytes]] | None = None


@pytest.fixture
def proxy(registry: Registry) -> Iterator[Proxy]:
    state = Proxy("", [])

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            state.paths.append(self.path)
            forwarded = {k: v for k, v in self.headers.items() if k.lower() in ("accept", "authorization")}
            upstream = httpx.get(f"http://{registry.host}{self.path}", headers=forwarded)
            keep = ("content-type", "docker-content-digest", "www-authenticate", "location")
            headers = {k: v for k, v in upstream.headers.items() if k.lower() in keep}
            status, body = upstream.status_code, upstream.content
            if state.tamper is not None:
                status, headers, body = state.tamper(self.path, headers, body)
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    with serve(Handler) as port:
        state.host = f"127.0.0.1:{port}"
        yield state
