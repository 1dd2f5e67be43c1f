"""A client for the OCI distribution API (Docker registry v2): manifests and blobs, with auth.

Registries answer an unauthenticated request with 401 and a ``WWW-Authenticate`` challenge:
``Basic`` (send the credentials) or ``Bearer realm=...,service=...,scope=...`` (fetch a token
from the realm, with the credentials if any, and send that). The client answers the challenge
once per request and keeps the resulting header for the next ones, so anonymous pulls from
Docker Hub, htpasswd-protected registries and token services all take the same path.

Every request, redirects and token requests included, must be HTTPS unless it goes to a
loopback address: a base image must not be swappable by anyone on the network path.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import TracebackType

import httpx

from aenv.template.image import (
    INDEX_TYPES,
    MANIFEST_TYPES,
    MAX_DOCUMENT,
    ImageNotFound,
    IntegrityError,
    RegistryAuthError,
    RegistryError,
    sha256_digest,
)
from aenv.template.reference import Reference, is_loopback, is_loopback_host

log = logging.getLogger(__name__)

CHUNK = 1 << 20
ACCEPT = ", ".join((*MANIFEST_TYPES, *INDEX_TYPES))
_CHALLENGE_PARAM = re.compile(r'(\w+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]*))')


@dataclass(frozen=True)
class Credentials:
    """A registry user name and password (or token), as ``fromImageRegistry`` gives them."""

    username: str
    password: str = field(repr=False)


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """``('bearer', {'realm': ..., 'service': ..., 'scope': ...})`` from a WWW-Authenticate header."""
    scheme, _, rest = header.strip().partition(" ")
    params = {m[1].lower(): m[2] if m[2] is not None else m[3] for m in _CHALLENGE_PARAM.finditer(rest)}
    return scheme.lower(), params


def read_capped(response: httpx.Response, limit: int, what: str) -> bytes:
    """The body of a streamed response, refusing one larger than ``limit`` bytes."""
    body = bytearray()
    for chunk in response.iter_bytes(CHUNK):
        body += chunk
        if len(body) > limit:
            raise RegistryError(f"{what} is larger than {limit} bytes")
    return bytes(body)


def _error_message(response: httpx.Response) -> str:
    """The registry's own explanation (``{"errors": [{"code", "message"}]}``) if it gave one."""
    try:
        body = read_capped(response, 64 << 10, "error response")
        errors = json.loads(body).get("errors") or []
        return "; ".join(f"{e.get('code', '')}: {e.get('message', '')}" for e in errors)
    except (ValueError, AttributeError, TypeError, httpx.HTTPError, RegistryError):
        return f"HTTP {response.status_code}"


class RegistryClient:
    """Read access to one repository of one registry; use as a context manager."""

    def __init__(
        self, reference: Reference, credentials: Credentials | None = None, *, timeout: float = 60.0
    ):
        self._ref = reference
        self._credentials = credentials
        self._client = httpx.Client(
            timeout=httpx.Timeout(timeout, connect=10.0),
            follow_redirects=True,
            headers={"User-Agent": "aenv"},
            event_hooks={"request": [self._check_url]},
        )
        self._base: str | None = None
        self._authorization: str | None = None

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._client.close()

    @staticmethod
    def _check_url(request: httpx.Request) -> None:
        if request.url.scheme != "https" and not is_loopback_host(request.url.host):
            raise RegistryError(
                f"refusing plain HTTP to {request.url.host}: only loopback registries may use it"
            )

    def _base_url(self) -> str:
        """``https://host``; a loopback registry that does not speak TLS is reached over HTTP."""
        if self._base is None:
            host = self._ref.api_host
            self._base = f"https://{host}"
            if is_loopback(host):
                try:
                    self._client.get(f"https://{host}/v2/").close()
                except httpx.TransportError:
                    self._base = f"http://{host}"
        return self._base

    def _send(self, path: str, accept: str | None = None) -> httpx.Response:
        """A streamed GET that answered with 2xx (the caller closes it); auth challenges answered."""
        url = self._base_url() + path
        headers = {"Accept": accept} if accept else {}
        for attempt in range(2):
            if self._authorization:
                headers["Authorization"] = self._authorization
            try:
                response = self._client.send(
                    self._client.build_request("GET", url, headers=headers), stream=True
                )
            except httpx.HTTPError as exc:
                raise RegistryError(f"cannot reach registry {self._ref.registry}: {exc}") from None
            if response.status_code != 401 or attempt:
                break
            challenge = response.headers.get("WWW-Authenticate", "")
            response.close()
            self._authorization = self._authenticate(challenge)
        if response.is_success:
            return response
        with contextlib.closing(response):
            message = _error_message(response) or f"HTTP {response.status_code}"
        if response.status_code in (401, 403):
            raise RegistryAuthError(
                f"registry {self._ref.registry} refused access to {self._ref.repository}: {message}"
            )
        if response.status_code == 404:
            raise ImageNotFound(f"{self._ref} not found: {message}")
        raise RegistryError(f"registry {self._ref.registry} answered {response.status_code}: {message}")

    def _authenticate(self, challenge: str) -> str:
        """The Authorization header that answers a 401's challenge."""
        scheme, params = parse_challenge(challenge)
        if scheme == "basic":
            if self._credentials is None:
                raise RegistryAuthError(f"registry {self._ref.registry} requires a user name and password")
            pair = f"{self._credentials.username}:{self._credentials.password}".encode()
            return "Basic " + base64.b64encode(pair).decode()
        if scheme == "bearer" and params.get("realm"):
            return "Bearer " + self._token(params)
        raise RegistryAuthError(
            f"registry {self._ref.registry} asks for unsupported authentication {challenge!r}"
        )

    def _token(self, params: dict[str, str]) -> str:
        """A pull token from the challenge's realm (docker's token protocol)."""
        query = {"scope": params.get("scope") or f"repository:{self._ref.repository}:pull"}
        if params.get("service"):
            query["service"] = params["service"]
        auth = (self._credentials.username, self._credentials.password) if self._credentials else None
        try:
            with self._client.stream("GET", params["realm"], params=query, auth=auth) as response:
                body = read_capped(response, MAX_DOCUMENT, "token response")
        except httpx.HTTPError as exc:
            raise RegistryError(f"cannot reach the token service of {self._ref.registry}: {exc}") from None
        if response.status_code in (401, 403):
            raise RegistryAuthError(f"the token service of {self._ref.registry} refused the credentials")
        if not response.is_success:
            raise RegistryError(f"the token service of {self._ref.registry} answered {response.status_code}")
        try:
            document = json.loads(body)
            token = document.get("token") or document.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise RegistryError(f"the token service of {self._ref.registry} sent no token")
        return token

    def manifest(self, ref: str) -> tuple[bytes, str]:
        """The manifest or index for a tag or digest, and the Content-Type the registry declared.

        The registry's ``Docker-Content-Digest`` header and a digest ``ref`` must both match the
        body's sha256: a registry that lies about what it serves is refused.
        """
        with contextlib.closing(
            self._send(f"/v2/{self._ref.repository}/manifests/{ref}", ACCEPT)
        ) as response:
            try:
                body = read_capped(response, MAX_DOCUMENT, f"manifest of {self._ref}")
            except httpx.HTTPError as exc:
                raise RegistryError(f"reading the manifest of {self._ref} failed: {exc}") from None
        actual = sha256_digest(body)
        claimed = response.headers.get("Docker-Content-Digest")
        if claimed and claimed != actual:
            raise IntegrityError(f"registry {self._ref.registry} claims manifest {claimed} but sent {actual}")
        if ref.startswith("sha256:") and actual != ref:
            raise IntegrityError(f"registry {self._ref.registry} sent {actual} when asked for manifest {ref}")
        return body, response.headers.get("Content-Type", "")

    def manifest_chunks(self, digest: str) -> Iterator[bytes]:
        """A manifest by digest as a byte stream, for the verifying blob store."""
        yield self.manifest(digest)[0]

    def blob_chunks(self, digest: str) -> Iterator[bytes]:
        """A blob's bytes as they arrive (the caller verifies size and digest while storing)."""
        with contextlib.closing(self._send(f"/v2/{self._ref.repository}/blobs/{digest}")) as response:
            try:
                yield from response.iter_bytes(CHUNK)
            except httpx.HTTPError as exc:
                raise RegistryError(f"download of {digest} from {self._ref.registry} failed: {exc}") from None
