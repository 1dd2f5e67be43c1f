"""`SchedulerClient`: the `Scheduler` protocol over the scheduler's HTTP routes.

Gateways and nodes hold one each. Error answers come back as the typed errors of
`aenv.orchestrator.errors` (the inverse of the API's status table), a scheduler that cannot be
reached, or that refuses the cluster secret, is `Unavailable`: callers retry later, or elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from .. import __version__
from ..api.server import STATUS
from ..orchestrator.errors import OperationFailed, SandboxError, Unavailable
from .auth import CLUSTER_SECRET_HEADER
from .model import Binding, Heartbeat, Location, NodeCapacity, NodeInfo, NodeUsage, Placement

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
KINDS: dict[int, type[SandboxError]] = {code: kind for kind, code in STATUS.items()}
# The scheduler answers from Redis in milliseconds; a slow answer is a scheduler in trouble.
TIMEOUT = httpx.Timeout(10.0, connect=3.0)
_NODES = TypeAdapter(list[NodeInfo])
_BINDINGS = TypeAdapter(list[Binding])


def _id(value: str) -> str:
    return quote(value, safe="")


class SchedulerClient:
    """The scheduler at `url` (e.g. http://10.0.0.2:9090), with the cluster secret if one is set."""

    def __init__(
        self,
        url: str,
        secret: str | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: httpx.Timeout = TIMEOUT,
    ):
        self.url = url.rstrip("/")
        headers = {"User-Agent": f"aenv/{__version__}"}
        if secret:
            headers[CLUSTER_SECRET_HEADER] = secret
        self.http = httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=timeout, transport=transport
        )

    async def close(self) -> None:
        await self.http.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise Unavailable(f"the scheduler at {self.url} is unreachable: {exc!r}") from exc
        if response.status_code >= 400:
            raise self._error(response)
        return response

    def _error(self, response: httpx.Response) -> SandboxError:
        try:
            message = str(response.json()["message"])
        except (ValueError, KeyError, TypeError):
            message = response.text[:200] or response.reason_phrase
        message = f"scheduler: {message}"
        if response.status_code == 401:  # the cluster's configuration is wrong, not the request
            return Unavailable(f"{message} (is AENV_CLUSTER_SECRET the scheduler's?)")
        return KINDS.get(response.status_code, OperationFailed)(message)

    async def _model(self, model: type[M], method: str, path: str, body: BaseModel | None = None) -> M:
        response = await self._request(method, path, **_body(body))
        return _decode(model.model_validate_json, response)

    # -- nodes -----------------------------------------------------------------------------

    async def register(self, node: NodeInfo) -> NodeInfo:
        return await self._model(NodeInfo, "POST", "/nodes", node)

    async def heartbeat(
        self, node_id: str, usage: NodeUsage, capacity: NodeCapacity, cached: list[str]
    ) -> NodeInfo:
        beat = Heartbeat(usage=usage, capacity=capacity, cached=cached)
        return await self._model(NodeInfo, "POST", f"/nodes/{_id(node_id)}/heartbeat", beat)

    async def nodes(self) -> list[NodeInfo]:
        return _decode(_NODES.validate_json, await self._request("GET", "/nodes"))

    async def node(self, node_id: str) -> NodeInfo:
        return await self._model(NodeInfo, "GET", f"/nodes/{_id(node_id)}")

    async def drain(self, node_id: str) -> NodeInfo:
        return await self._model(NodeInfo, "POST", f"/nodes/{_id(node_id)}/drain")

    # -- placement and bindings ------------------------------------------------------------

    async def place(self, request: Placement) -> NodeInfo:
        return await self._model(NodeInfo, "POST", "/placements", request)

    async def bind(self, binding: Binding) -> None:
        await self._request("PUT", f"/bindings/{_id(binding.sandbox_id)}", **_body(binding))

    async def unbind(self, sandbox_id: str, node_id: str) -> None:
        await self._request("DELETE", f"/bindings/{_id(sandbox_id)}", params={"node_id": node_id})

    async def locate(self, sandbox_id: str) -> tuple[Binding, NodeInfo]:
        location = await self._model(Location, "GET", f"/bindings/{_id(sandbox_id)}")
        return location.binding, location.node

    async def bindings(self, node_id: str | None = None) -> list[Binding]:
        params = {"node_id": node_id} if node_id is not None else {}
        return _decode(_BINDINGS.validate_json, await self._request("GET", "/bindings", params=params))


def _body(model: BaseModel | None) -> dict[str, Any]:
    if model is None:
        return {}
    return {"content": model.model_dump_json(), "headers": {"Content-Type": "application/json"}}


def _decode(validate: Callable[[bytes], T], response: httpx.Response) -> T:
    """The answer's body as the expected record; a body that is not one is the scheduler failing."""
    try:
        return validate(response.content)
    except ValidationError as exc:
        raise OperationFailed(f"the scheduler at {response.url} answered an unexpected body: {exc}") from exc
