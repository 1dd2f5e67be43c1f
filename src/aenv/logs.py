"""The server processes' logging: plain text for a terminal, or one JSON object a line for a log
pipeline (`AENV_LOG_FORMAT=json`), with the sandbox a line is about in its own field.

The sandbox comes from a context variable that the API binds for each request naming a sandbox
(its route's `sandboxID`, or the sandbox a data-plane request is relayed to), and that the node's
own loops bind around the work they do for one sandbox. asyncio copies the context into every
task a request starts, so background work a request begins (a snapshot's commit, say) logs with
its sandbox too.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from datetime import UTC, datetime

from aiohttp import web

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

SANDBOX_ID: ContextVar[str | None] = ContextVar("aenv_sandbox_id", default=None)


@contextlib.contextmanager
def sandbox_context(sandbox_id: str) -> Iterator[None]:
    """Lines logged within are about `sandbox_id`."""
    token = SANDBOX_ID.set(sandbox_id)
    try:
        yield
    finally:
        SANDBOX_ID.reset(token)


class JsonFormatter(logging.Formatter):
    """A record as one JSON object: time (RFC 3339, UTC), level, logger, message, sandbox_id when
    the line is about one, and the traceback of an exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if (sandbox_id := SANDBOX_ID.get()) is not None:
            entry["sandbox_id"] = sandbox_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(level: str, log_format: str = "text") -> None:
    """Logging for a server process (node, gateway, scheduler), to standard error."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def request_context(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Binds the sandbox a request's route names, for the lines logged while it is answered."""
    sandbox_id = request.match_info.get("sandboxID")
    if sandbox_id is None:
        return await handler(request)
    with sandbox_context(sandbox_id):
        return await handler(request)
