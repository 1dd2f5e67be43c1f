"""The API's OpenAPI document, assembled from the route table and the request models."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from .. import __version__
from . import schemas

Route = tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]

# Which request body each operation takes (by handler name), and its success status.
BODIES: dict[str, type[BaseModel]] = {
    "create_v1": schemas.NewSandbox,
    "create_v2": schemas.NewSandbox,
    "set_timeout": schemas.TimeoutRequest,
    "refresh": schemas.RefreshRequest,
    "pause": schemas.PauseRequest,
    "resume": schemas.ResumeSandbox,
    "connect": schemas.ConnectSandbox,
    "create_snapshot": schemas.SnapshotRequest,
    "fork": schemas.ForkRequest,
    "update_network": schemas.NetworkUpdate,
}
SUCCESS = {
    "create_v1": "201",
    "create_v2": "201",
    "create_snapshot": "201",
    "fork": "201",
    "resume": "201",
    "connect": "200",
    "health": "204",
    "kill": "204",
    "set_timeout": "204",
    "refresh": "204",
    "pause": "204",
    "update_network": "204",
    "delete_template": "204",
}
ERROR_SCHEMA = {
    "type": "object",
    "required": ["code", "message"],
    "properties": {"code": {"type": "integer"}, "message": {"type": "string"}},
}


def _operation(method: str, handler: Callable[..., Any]) -> dict[str, Any]:
    name = handler.__name__
    doc = (handler.__doc__ or name.replace("_", " ")).strip().splitlines()[0]
    operation: dict[str, Any] = {
        "operationId": f"{method.lower()}_{name}",
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
            "required": name in ("create_v1", "create_v2", "set_timeout", "update_network"),
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    return operation


def document(routes: list[Route]) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for method, path, handler in routes:
        operation = _operation(method, handler)
        parameters = [
            {"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
            for p in re.findall(r"{(\w+)}", path)
        ]
        if parameters:
            operation["parameters"] = parameters
        if path not in ("/health", "/metrics", "/openapi.json"):
            operation["security"] = [{"ApiKeyAuth": []}]
        paths.setdefault(path, {})[method.lower()] = operation
    components: dict[str, Any] = {"Error": ERROR_SCHEMA}
    for model in {m.__name__: m for m in BODIES.values()}.values():
        schema = model.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
    return {
        "openapi": "3.0.3",
        "info": {"title": "aenv node API (E2B-compatible)", "version": __version__},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"ApiKeyAuth": {"type": "apiKey", "in": "header", "name": "X-API-Key"}},
        },
    }
