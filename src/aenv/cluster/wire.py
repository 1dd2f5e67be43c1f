"""`NodeService` over HTTP: the node's internal route a gateway calls it through.

The E2B API renders records for clients (it leaves out timeouts, environment, traffic tokens,
pause modes) and names no node, so a gateway that re-rendered records from it would lose what it
forwards. Instead every `NodeService` call travels whole: `POST /cluster/node/{method}` with the
call's keyword arguments as JSON, answered with `{"result": ...}` or the node's usual
`{"code", "message"}` error. The JSON shapes come from the protocol's own type hints (pydantic
`TypeAdapter`s), so a method added to `NodeService` works through the gateway without a second
mapping to keep in step. Answers are written and read by pydantic's JSON codec, which turns a
page of records into bytes and back in a fraction of the time of `json` with Python-side dumping
and validation (a list through a gateway carries a page from every node). The route is internal:
it is mounted outside the public OpenAPI routes and, on a node in a cluster, taken only with the
cluster secret (`aenv.cluster.auth`).

One call does not travel this way: `receive_template_file`, a streamed upload, forwarded to the
node's presigned upload URL as it is. (`route` is not `NodeService`'s but `RouteService`'s, which
only a node serves.)
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, get_type_hints

from aiohttp import web
from pydantic import TypeAdapter, ValidationError
from typing_extensions import TypedDict

from ..orchestrator.errors import InvalidRequest, NotFound
from ..orchestrator.interface import NodeService

CALL_PATH = "/cluster/node/{method}"
LOCAL_ONLY = frozenset({"receive_template_file"})
CALLS = frozenset(name for name in dir(NodeService) if not name.startswith("_") and name not in LOCAL_ONLY)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@functools.cache
def _adapters(method: str) -> tuple[dict[str, TypeAdapter[Any]], TypeAdapter[Any]]:
    """The call's arguments, and its whole answer `{"result": ...}`."""
    if method not in CALLS:
        raise NotFound(f"no node call {method!r}")
    hints = get_type_hints(getattr(NodeService, method))
    # The functional form: the result's type is known only here.
    answer = TypedDict(f"{method}_answer", {"result": hints.pop("return")})  # type: ignore[operator]  # noqa: UP013
    return {name: TypeAdapter(kind) for name, kind in hints.items()}, TypeAdapter(answer)


def call_path(method: str) -> str:
    return CALL_PATH.format(method=method)


def encode_arguments(method: str, arguments: dict[str, Any]) -> dict[str, Any]:
    parameters, _ = _adapters(method)
    return {
        name: parameters[name].dump_python(value, mode="json", by_alias=True)
        for name, value in arguments.items()
    }


def decode_arguments(method: str, body: Any) -> dict[str, Any]:
    parameters, _ = _adapters(method)
    if not isinstance(body, dict) or not set(body) <= set(parameters):
        raise InvalidRequest(f"{method} takes the arguments {sorted(parameters)}")
    try:
        return {name: parameters[name].validate_python(value) for name, value in body.items()}
    except ValidationError as exc:
        raise InvalidRequest(f"invalid arguments to {method}: {exc}") from exc


def encode_answer(method: str, value: Any) -> bytes:
    """The node's answer to a call, `{"result": value}`, as JSON."""
    return _adapters(method)[1].dump_json({"result": value}, by_alias=True)


def decode_answer(method: str, content: bytes) -> Any:
    """The result in a node's answer; a ValidationError (a ValueError) for a body that is not one."""
    return _adapters(method)[1].validate_json(content)["result"]


def node_route(node: NodeService) -> tuple[str, str, Handler]:
    """The internal route serving `node`'s calls (mount it behind the node's authentication)."""

    async def call(request: web.Request) -> web.Response:
        method = request.match_info["method"]
        try:
            body = await request.json()
        except ValueError as exc:
            raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
        arguments = decode_arguments(method, body)
        result = await getattr(node, method)(**arguments)
        return web.Response(body=encode_answer(method, result), content_type="application/json")

    return "POST", CALL_PATH, call
