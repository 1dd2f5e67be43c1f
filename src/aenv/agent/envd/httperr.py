"""Plain-HTTP JSON errors in the reference envd shape: {"code": <status>, "message": "..."}."""

from __future__ import annotations

import json

from aiohttp import web

UNAUTHORIZED = "unauthorized access, please provide a valid access token or method signing if supported"


def json_error(status: int, message: str) -> web.Response:
    return web.Response(
        text=json.dumps({"code": status, "message": message}),
        status=status,
        content_type="application/json",
        charset="utf-8",
    )
