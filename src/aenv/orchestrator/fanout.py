"""Fan-out: N sandboxes from one template or snapshot in one call, each succeeding or failing alone.

The same code serves a node (its creates) and a gateway (creates placed over the cluster's nodes,
`aenv.cluster.clusternode`): it is given the service's `create` and `get`.

Idempotency without state: with a key, sandbox i of the call has the id `member_id(key, i)`, so
a retried call (after a timeout, a lost answer, a gateway that died) looks each of them up first
and creates only those that do not exist. Nothing needs to remember the first call, so any
gateway answers the retry the same. A sandbox of the call killed meanwhile is made again by a
retry: the key names the sandboxes, not a moment.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import replace

from .errors import Conflict, InvalidRequest, NotFound, SandboxError
from .ids import new_sandbox_id, sandbox_id_of
from .interface import CreateRequest, FanOutFailure, FanOutRequest, FanOutResult
from .store import SandboxRecord

MAX_FAN_OUT = 1000
# Creates one call runs at once: a node serializes most of a create's work on its 2 cores anyway,
# and each waiting create holds a network slot and a reservation of memory.
CONCURRENCY = 16


def member_id(key: str, index: int) -> str:
    """The id of sandbox `index` of the fan-out with idempotency key `key` (a sandbox id's form)."""
    digest = hashlib.sha256(f"aenv-fan-out\0{key}\0{index}".encode()).digest()
    return sandbox_id_of(int.from_bytes(digest[:16]))


def failure(error: SandboxError) -> FanOutResult:
    return FanOutResult(error=FanOutFailure(type(error).__name__, error.message, error.error_code))


async def fan_out(
    request: FanOutRequest,
    create: Callable[[CreateRequest], Awaitable[SandboxRecord]],
    get: Callable[[str], Awaitable[SandboxRecord]],
    concurrency: int = CONCURRENCY,
) -> list[FanOutResult]:
    """One result per sandbox, in order; refusals and failures are results, not exceptions."""
    if not 1 <= request.count <= MAX_FAN_OUT:
        raise InvalidRequest(f"count must be between 1 and {MAX_FAN_OUT}")
    key = request.idempotency_key
    ids = [member_id(key, i) if key else new_sandbox_id() for i in range(request.count)]
    gate = asyncio.Semaphore(concurrency)

    async def one(sandbox_id: str) -> FanOutResult:
        async with gate:
            try:
                if key is not None:
                    try:
                        return FanOutResult(sandbox=await get(sandbox_id))
                    except NotFound:
                        pass
                try:
                    return FanOutResult(sandbox=await create(replace(request.create, sandbox_id=sandbox_id)))
                except Conflict:  # made by a retry of the same call running alongside
                    if key is None:
                        raise
                    return FanOutResult(sandbox=await get(sandbox_id))
            except SandboxError as exc:
                return failure(exc)

    return list(await asyncio.gather(*(one(i) for i in ids)))
