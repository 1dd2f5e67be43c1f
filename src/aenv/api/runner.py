"""The node's HTTP server: requests that aiohttp's parser rejects get the API's JSON errors too.

A request line or header that the parser refuses (a URL longer than the line limit, bytes that
are not HTTP) never reaches the application or its middlewares: aiohttp's connection handler
answers it itself, in plain text, and logs an ERROR with a traceback. Here the connection handler
answers such requests like every other error, with `{"code", "message"}`, and logs them as what
they are, a client's mistake.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from aiohttp import web

from .server import error_response

log = logging.getLogger(__name__)
# Connections waiting to be accepted (aiohttp's default is 128): a gateway opens one to a node per
# call in flight, and an RL trainer's 256 concurrent creates arrive at once; past the backlog the
# kernel drops SYNs, which the client resends only after 1 s, then 3 s, and so on.
BACKLOG = 1024


class _JSONErrorRequestHandler(web.RequestHandler):
    """aiohttp's connection handler, with JSON bodies for the errors it answers itself."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        else:
            log.info("refused a malformed HTTP request from %s: %s", request.remote, message or exc)
        if request.writer.output_size > 0:  # as aiohttp: a response is under way, the connection is lost
            raise ConnectionError("response already started, cannot send an error response")
        response = error_response(status, message or HTTPStatus(status).phrase)
        response.force_close()
        return response


class _Server(web.Server):
    def __call__(self) -> web.RequestHandler:
        return _JSONErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class APIRunner(web.AppRunner):
    """`web.AppRunner` whose connections answer unparseable requests with the API's JSON errors."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # the same server; only the connection handlers it makes differ
        return server
