"""Application assembly: routes, access-token middleware, CORS, lifecycle."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from . import build_api
from .connect import MAX_MESSAGE_BYTES
from .fastinit import InitFastPath
from .files_api import FilesAPI
from .filesystem import FilesystemService
from .httperr import UNAUTHORIZED, json_error
from .metrics import MetricsHistory
from .process import ProcessService
from .state import State, same_secret
from .system_api import SystemAPI

log = logging.getLogger(__name__)

# Paths that do their own authorisation (reference envd `authExcludedPaths`).
AUTH_EXCLUDED = {("GET", "/health"), ("GET", "/files"), ("POST", "/files"), ("POST", "/init")}
CORS_EXPOSE = "Connect-Protocol-Version, Grpc-Status, Grpc-Message, Grpc-Status-Details-Bin, Content-Encoding"

MAX_REQUEST_LINE = 64 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(state: State, history: MetricsHistory) -> web.Application:
    processes = ProcessService(state)
    filesystem = FilesystemService(state)

    @web.middleware
    async def access(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "OPTIONS":
            return web.Response(
                status=204,
                headers={
                    "Access-Control-Allow-Methods": "*",
                    "Access-Control-Allow-Headers": "*",
                    "Access-Control-Max-Age": "7200",
                },
            )
        token = state.access_token
        sent = request.headers.get("X-Access-Token", "")
        exempt = (request.method, request.path) in AUTH_EXCLUDED
        if token and not exempt and not same_secret(sent, token):
            return json_error(401, UNAUTHORIZED)
        try:
            return await handler(request)
        except web.HTTPException as e:  # aiohttp's own refusals (too large, not found, ...) as JSON
            if e.status < 400:
                raise
            response = json_error(e.status, e.reason)
            if "Allow" in e.headers:
                response.headers["Allow"] = e.headers["Allow"]
            return response
        except Exception:  # Connect routes answer their own errors; this is the HTTP routes' last resort
            log.exception("%s %s failed", request.method, request.path)
            return json_error(500, "internal error")

    async def cors(request: web.Request, response: web.StreamResponse) -> None:
        response.headers.setdefault("Access-Control-Allow-Origin", "*")
        response.headers.setdefault("Access-Control-Expose-Headers", CORS_EXPOSE)

    async def startup(app: web.Application) -> None:
        history.start()

    async def shutdown(app: web.Application) -> None:
        processes.shutdown()
        filesystem.shutdown()
        await history.stop()

    app = web.Application(middlewares=[access], client_max_size=MAX_MESSAGE_BYTES)
    app.on_response_prepare.append(cors)
    app.on_startup.append(startup)
    app.on_shutdown.append(shutdown)
    app.add_routes(SystemAPI(state, history).routes())
    app.add_routes(FilesAPI(state).routes())
    app.add_routes(processes.routes())
    app.add_routes(filesystem.routes())
    app.add_routes(build_api.routes())
    app.router.add_route("OPTIONS", "/{tail:.*}", _no_content)
    return app


async def _no_content(request: web.Request) -> web.Response:
    return web.Response(status=204)


def runner_options() -> dict[str, object]:
    """aiohttp >= 3.9 stops cancelling handlers on client disconnect by default; streams rely on it.

    The request line may be long enough for a query naming a PATH_MAX path in percent-encoded UTF-8,
    so that envd itself judges such a path (with a JSON error) rather than the HTTP parser."""
    major, minor = (int(p) for p in aiohttp.__version__.split(".")[:2])
    options: dict[str, object] = {"max_line_size": MAX_REQUEST_LINE}
    if (major, minor) >= (3, 9):
        options["handler_cancellation"] = True
    return options


async def serve(state: State, host: str, port: int) -> None:
    """Run until cancelled. Connections meet `InitFastPath` first, which hands them to aiohttp
    unless they are the node's `/init` or `/metrics/history`."""
    history = MetricsHistory()
    runner = web.AppRunner(build_app(state, history), access_log=None, **runner_options())  # type: ignore[arg-type]
    await runner.setup()
    server = runner.server
    assert server is not None
    listener = await asyncio.get_running_loop().create_server(
        lambda: InitFastPath(state, history, server), host, port, reuse_address=True
    )
    log.info("envd listening on %s:%d (user %s)", host, port, state.default_user)
    try:
        await asyncio.Event().wait()
    finally:
        listener.close()
        await runner.cleanup()
