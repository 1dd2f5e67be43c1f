"""The control-plane client: the same REST API the E2B SDKs call, with errors turned into one sentence."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlencode

import httpx

from .. import __version__
from .config import CLIError, Credentials

TIMEOUT = httpx.Timeout(120.0, connect=5.0)


def server_message(response: httpx.Response) -> str:
    """The `message` of an E2B error body, else the body's text, else the reason phrase."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("message"):
        return str(body["message"])
    text = response.text.strip()
    return text[:300] if text else response.reason_phrase


def http_error(response: httpx.Response) -> CLIError:
    message = server_message(response).rstrip(".")
    if response.status_code == 401:
        return CLIError(
            f"authentication failed (HTTP 401): {message}; run `aenv auth` to update your API key",
            status=401,
        )
    return CLIError(f"{message} (HTTP {response.status_code})", status=response.status_code)


def unreachable(url: str, exc: Exception) -> CLIError:
    reason = str(exc) or type(exc).__name__
    return CLIError(
        f"cannot reach the aenv server at {url} ({reason}); is it running, and are AENV_URL "
        "or `aenv auth` pointing at it?"
    )


class Api:
    """Thin synchronous wrapper; every method returns decoded JSON (None for empty bodies)."""

    def __init__(self, credentials: Credentials, timeout: httpx.Timeout = TIMEOUT) -> None:
        self.credentials = credentials
        self.url = credentials.url
        self.http = httpx.Client(
            base_url=credentials.url,
            headers={"X-API-Key": credentials.api_key, "User-Agent": f"aenv-cli/{__version__}"},
            timeout=timeout,
        )

    def request(self, method: str, path: str, *, json: Any = None, params: Any = None) -> httpx.Response:
        try:
            response = self.http.request(method, path, json=json, params=params)
        except httpx.TransportError as exc:
            raise unreachable(self.url, exc) from exc
        if response.status_code >= 400:
            raise http_error(response)
        return response

    def call(self, method: str, path: str, *, json: Any = None, params: Any = None) -> Any:
        response = self.request(method, path, json=json, params=params)
        return response.json() if response.content else None

    def pages(self, path: str, params: dict[str, str] | None = None) -> Iterator[Any]:
        """Every item of a paged list, following `X-Next-Token`."""
        params = {**(params or {}), "limit": "100"}
        while True:
            response = self.request("GET", path, params=params)
            yield from response.json()
            token = response.headers.get("X-Next-Token")
            if not token:
                return
            params["nextToken"] = token

    # -- sandboxes ---------------------------------------------------------------------------

    def sandbox(self, sandbox_id: str) -> dict[str, Any]:
        return self.call("GET", f"/sandboxes/{quote(sandbox_id, safe='')}")

    def sandboxes(self, states: list[str], metadata: dict[str, str]) -> list[dict[str, Any]]:
        params = {}
        if states:
            params["state"] = ",".join(states)
        if metadata:
            params["metadata"] = urlencode(metadata)
        return list(self.pages("/v2/sandboxes", params))

    def connect(self, sandbox_id: str, timeout: int | None) -> dict[str, Any]:
        body = {} if timeout is None else {"timeout": timeout}
        return self.call("POST", f"/sandboxes/{quote(sandbox_id, safe='')}/connect", json=body)

    def template(self, reference: str) -> dict[str, Any]:
        return self.call("GET", f"/templates/{quote(reference, safe='')}")
