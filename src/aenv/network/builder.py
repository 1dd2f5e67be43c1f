"""Sandbox networks made on a thread of their own, off the node's event loop.

Making a network is a dozen netlink requests (pyroute2, whose messages are built and parsed in
Python), a veth pair and an nft load. The kernel handles a netlink request inside the sender's
`sendmsg` under the RTNL lock, which every veth deleted elsewhere holds through an RCU grace period
(`SandboxNetwork.aclose`), so a request can block for tens of milliseconds. On the event loop that
is a stall of every API request and proxied call: at 256 concurrent rollouts (bench `rollout`, 2
cores, TCG) refilling the network pool was 21 % of the node loop's busy time, the largest part
after serving requests. Here the pool's networks are made by one long-lived thread running an
event loop of its own (`build`), so a blocked `sendmsg` blocks only that thread, and the node's
loop waits for the GIL at most a switch interval (5 ms) while the builder runs Python.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

from .egress import EgressPolicy
from .netns import SandboxNetwork
from .slots import Slot

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def _builder_loop() -> asyncio.AbstractEventLoop:
    """The builder thread's loop, started on first use; it lives as long as the process."""
    global _loop
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="network-builder", daemon=True).start()
            _loop = loop
        return _loop


async def build(
    name: str,
    slot: Slot | None,
    policy: EgressPolicy | None,
    on_destroy: Callable[[Slot], None] | None = None,
) -> SandboxNetwork:
    """`SandboxNetwork.create(name, slot, policy, on_destroy)`, run on the builder thread.

    Cancelled meanwhile, it waits until the network is made and removes it before it gives up:
    the caller may reuse the name and the slot at once, as it could after a cancelled `create`.
    """
    made = asyncio.wrap_future(
        asyncio.run_coroutine_threadsafe(
            SandboxNetwork.create(name, slot, policy, on_destroy), _builder_loop()
        )
    )
    try:
        return await asyncio.shield(made)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):  # a failed create removed what it made itself
            await (await made).aclose()
        raise
