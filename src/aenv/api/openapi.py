"""The API's OpenAPI document, assembled from the route table and the request models.

OpenAPI 3.1, whose schemas are JSON Schema 2020-12: what pydantic generates for the request
models, `null` for optional fields included.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from .. import __version__
from . import rollouts, schemas, templates, volumes

Route = tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]

# Which request body each operation takes (by handler name), and its success status.
BODIES: dict[str, type[BaseModel]] = {
    "create_v1": schemas.NewSandboxV1,
    "create_v2": schemas.NewSandbox,
    "set_timeout": schemas.TimeoutRequest,
    "refresh": schemas.RefreshRequest,
    "pause": schemas.PauseRequest,
    "resume": schemas.ResumeSandbox,
    "take_over": schemas.TakeOver,
    "connect": schemas.ConnectSandbox,
    "create_snapshot": schemas.SnapshotRequest,
    "fork": schemas.ForkRequest,
    "update_network": schemas.NetworkUpdate,
}
BODIES.update(templates.BODIES)
BODIES.update(volumes.BODIES)
BODIES.update(rollouts.BODIES)
SUCCESS = {
    "create_v1": "201",
    "create_v2": "201",
    "create_snapshot": "201",
    "fork": "201",
    "resume": "201",
    "take_over": "201",
    "connect": "200",
    "health": "204",
    "kill": "204",
    "discard_pause": "204",
    "set_timeout": "204",
    "refresh": "204",
    "pause": "204",
    "update_network": "204",
    "delete_template": "204",
}
SUCCESS.update(templates.SUCCESS)
SUCCESS.update(volumes.SUCCESS)
SUCCESS.update(rollouts.SUCCESS)
ERROR_SCHEMA = {
    "type": "object",
    "required": ["code", "message"],
    "properties": {"code": {"type": "integer"}, "message": {"type": "string"}},
}


def _operation(method: str, path: str, handler: Callable[..., Any], shared: bool) -> dict[str, Any]:
    name = handler.__name__
    doc = (handler.__doc__ or name.replace("_", " ")).strip().splitlines()[0]
    operation_id = f"{method.lower()}_{name}"
    if shared:  # one handler behind several paths (E2B's v1 and v2 spellings): ids stay unique
        operation_id += "_v2" if path.startswith("/v2/") else "_v1"
    operation: dict[str, Any] = {
        "operationId": operation_id,
        "summary": doc,
        "responses": {
            SUCCESS.get(name, "200"): {"description": "success"},
            "default": {
                "description": "error",
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
            },
        },
    }
    if name in BODIES:
        model = BODIES[name]
        operation["requestBody"] = {
            "required": name
            in (
                "create_v1",
                "create_v2",
                "set_timeout",
                "update_network",
                *templates.BODIES,
                *volumes.BODIES,
                *rollouts.REQUIRED,
            ),
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    return operation


def _fill_limits(node: Any, limits: dict[str, int]) -> None:
    """Replace each `LIMIT_KEY` marker in the schemas by `maximum`: the node's value of that setting."""
    if isinstance(node, dict):
        if (setting := node.pop(schemas.LIMIT_KEY, None)) is not None:
            node["maximum"] = limits[setting]
        for value in node.values():
            _fill_limits(value, limits)
    elif isinstance(node, list):
        for value in node:
            _fill_limits(value, limits)


# Query parameters an operation cannot do without (by handler name).
QUERY_PARAMETERS: dict[str, list[dict[str, Any]]] = {
    "sandboxes_metrics": [
        {
            "name": "sandbox_ids",
            "in": "query",
            "required": True,
            "description": "1 to 100 sandbox IDs, comma-separated",
            "schema": {"type": "string", "pattern": "^[a-z0-9]{1,64}(,[a-z0-9]{1,64}){0,99}$"},
        }
    ],
}
QUERY_PARAMETERS.update(volumes.QUERY_PARAMETERS)


def document(routes: list[Route], limits: dict[str, int]) -> dict[str, Any]:
    """The document for these routes, with the bounds of this node's `limits` (schemas.limits)."""
    paths: dict[str, dict[str, Any]] = {}
    uses = Counter((method, handler.__name__) for method, _, handler in routes)
    for method, path, handler in routes:
        operation = _operation(method, path, handler, uses[method, handler.__name__] > 1)
        parameters = [
            {
                "name": p,
                "in": "path",
                "required": True,
                "schema": templates.PATH_SCHEMAS.get(p, {"type": "string"}),
            }
            for p in re.findall(r"{(\w+)}", path)
        ]
        parameters += QUERY_PARAMETERS.get(handler.__name__, [])
        if parameters:
            operation["parameters"] = parameters
        if path.startswith(volumes.CONTENT_PREFIX):
            operation["security"] = [{"VolumeToken": []}]
        elif path not in ("/health", "/metrics", "/openapi.json"):
            operation["security"] = [{"ApiKeyAuth": []}]
        paths.setdefault(path, {})[method.lower()] = operation
    components: dict[str, Any] = {"Error": ERROR_SCHEMA}
    for model in {m.__name__: m for m in BODIES.values()}.values():
        schema = model.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
    _fill_limits(components, limits)
    return {
        "openapi": "3.1.0",
        "info": {"title": "aenv node API (E2B-compatible)", "version": __version__},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "ApiKeyAuth": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
                "VolumeToken": {"type": "http", "scheme": "bearer", "description": "the volume's token"},
            },
        },
    }
