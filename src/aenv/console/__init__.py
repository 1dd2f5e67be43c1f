"""The web console at `/console`, served by every node and gateway.

The page is a static shell with no data in it, so it is served without the API key; everything it
shows comes from the JSON API, called by the page with the key the operator enters once (kept in the
tab's sessionStorage), and the terminal's WebSocket checks the same key in its first message
(`terminal.terminal_socket`). xterm.js comes from npm (`package.json` here, installed by
`make setup-console` into `node_modules/`), never from a CDN; without it the console answers a 503
that says how to install it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

HERE = Path(__file__).parent
STATIC = HERE / "static"
NODE_MODULES = HERE / "node_modules"
# The only files served from node_modules: the browser builds of xterm.js and its fit addon.
VENDOR = {
    "xterm.js": "@xterm/xterm/lib/xterm.js",
    "xterm.css": "@xterm/xterm/css/xterm.css",
    "addon-fit.js": "@xterm/addon-fit/lib/addon-fit.js",
}
SHELL = {"index.html", "console.js", "console.css"}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def missing() -> web.Response:
    message = (
        f"the console's browser dependencies are not installed in {NODE_MODULES}: "
        f"run `make setup-console` (npm ci --prefix {HERE}) and reload"
    )
    return web.json_response({"code": 503, "message": message}, status=503)


async def page(request: web.Request) -> web.StreamResponse:
    if not all((NODE_MODULES / path).is_file() for path in VENDOR.values()):
        return missing()
    return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


async def asset(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    if name in SHELL:
        return web.FileResponse(STATIC / name, headers={"Cache-Control": "no-cache"})
    if name in VENDOR:
        path = NODE_MODULES / VENDOR[name]
        return web.FileResponse(path) if path.is_file() else missing()
    raise web.HTTPNotFound(text=f"no console file {name!r}")


async def terminal_socket(request: web.Request) -> web.StreamResponse:
    """The terminal's WebSocket (`terminal.terminal_socket`)."""
    # Imported on first use: the relay uses the CLI's envd client, and `aenv.cli` imports this server.
    from .terminal import terminal_socket as relay

    return await relay(request)


def public(handler: Handler) -> Handler:
    handler.public = True  # type: ignore[attr-defined]  # the API key check skips it
    return handler


def routes() -> list[tuple[str, str, Handler]]:
    return [
        ("GET", "/console", public(page)),
        # The socket's first message carries the API key (a browser cannot set its headers).
        ("GET", "/console/terminal/{sandboxID}", public(terminal_socket)),
        ("GET", "/console/{name}", public(asset)),
    ]
