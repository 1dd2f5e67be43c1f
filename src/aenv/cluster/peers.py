"""The peers of a node in a cluster: the other live nodes the scheduler lists (`aenv.runtime.peers`).

Here, not beside the peer transport, because it reads the scheduler's node list (`NodeInfo`):
the transport knows only base URLs, and the node gives `open_storage` these peers when it
belongs to a cluster.
"""

from __future__ import annotations

import logging
import threading
import time

import httpx
from pydantic import TypeAdapter, ValidationError

from ..runtime.peers import peer_headers
from .model import NodeInfo, NodeState

log = logging.getLogger(__name__)

PEERS_TTL = 5.0  # seconds a scheduler's node list is used before it is asked again
SCHEDULER_TIMEOUT = httpx.Timeout(3.0)
_NODES = TypeAdapter(list[NodeInfo])


class SchedulerPeers:
    """The cluster's other live nodes, as the scheduler lists them, cached for `ttl` seconds.

    A scheduler that cannot be reached means no peers for now (the store still answers).
    """

    def __init__(self, scheduler_url: str, node_id: str, secret: str | None, ttl: float = PEERS_TTL):
        # The first of several schedulers (AENV_SCHEDULER_URL may list them): any one lists the nodes.
        self.url = scheduler_url.split(",")[0].strip().rstrip("/") + "/nodes"
        self.node_id = node_id
        self.headers = peer_headers(secret)
        self.ttl = ttl
        self._lock = threading.Lock()
        self._urls: list[str] = []
        self._at = float("-inf")

    def urls(self) -> list[str]:
        with self._lock:
            if time.monotonic() - self._at >= self.ttl:
                self._urls, self._at = self._ask(), time.monotonic()
            return list(self._urls)

    def _ask(self) -> list[str]:
        try:
            response = httpx.get(self.url, headers=self.headers, timeout=SCHEDULER_TIMEOUT)
            response.raise_for_status()
            nodes = _NODES.validate_json(response.content)
        except (httpx.HTTPError, ValidationError) as exc:
            log.warning("no peers for now: the scheduler's node list failed: %s", exc)
            return []
        return [
            n.address.rstrip("/") for n in nodes if n.node_id != self.node_id and n.status != NodeState.DOWN
        ]
