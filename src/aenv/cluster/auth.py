"""The cluster secret: what gateways and the scheduler present to nodes, and nodes to them.

A node with a cluster secret is not an open door: every request but the public ones (health,
metrics, the OpenAPI document) must carry the secret, control calls and proxied sandbox traffic
alike. The gateway checks the users' API key and adds the secret on its way to the node; envd's
access tokens and the traffic tokens are still checked by the node as without a cluster.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from aiohttp import web

from ..headers import CLUSTER_SECRET_HEADER

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def presents_secret(headers: Any, secret: str) -> bool:
    """Whether `headers` carry exactly one copy of `secret` (compared in constant time)."""
    presented = headers.getall(CLUSTER_SECRET_HEADER, [])
    return len(presented) == 1 and hmac.compare_digest(presented[0].encode(), secret.encode())


def cluster_gate(
    secret: str, public: Collection[str], refuse: Callable[[int, str], web.StreamResponse]
) -> Callable[..., Any]:
    """Middleware: anything but `public` paths is refused (401, via `refuse`) without the secret."""

    @web.middleware
    async def gate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in public or presents_secret(request.headers, secret):
            return await handler(request)
        return refuse(401, "this node belongs to a cluster: call it through a gateway")

    return gate
