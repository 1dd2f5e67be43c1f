"""Ending the background tasks the node's parts own (collectors, pool fillers, heartbeats, loops).

Each part that starts a task ends it when it closes, and waits for it: what the task was doing
(a collection, a refill, a push to the scheduler) must not run on after its owner is gone. Its
cancellation is how it is meant to end, so that is not an error.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` (if any) and wait until it has ended."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
