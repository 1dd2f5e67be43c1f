"""Plain-HTTP JSON errors in the reference envd shape: {"code": <status>, "message": "..."}."""

from __future__ import annotations

from aiohttp import web


def json_error(status: int, message: str) -> web.Response:
    return web.json_response({"code": status, "message": message}, status=status,
                             content_type="application/json", charset="utf-8")


UNAUTHORIZED = "unauthorized access, please provide a valid access token or method signing if supported"
