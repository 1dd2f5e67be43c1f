"""Pool networks are made on the builder thread, off the event loop (`aenv.network.builder`)."""

from __future__ import annotations

import asyncio
import secrets
import threading

import pytest

from aenv.network import builder, netns
from aenv.network.slots import SlotAllocator

from .conftest import namespaces, root_links

pytestmark = pytest.mark.asyncio(loop_scope="session")
SLOTS = (6136, 8)  # this module's own, at the top of the range of the helper that wrote it


async def test_a_network_is_made_on_the_builder_thread(monkeypatch: pytest.MonkeyPatch):
    threads: list[str] = []
    make_tap = netns.make_tap

    def recorded(name: str) -> None:
        threads.append(threading.current_thread().name)
        make_tap(name)

    monkeypatch.setattr(netns, "make_tap", recorded)
    slots = SlotAllocator(*SLOTS)
    network = await builder.build(f"aenvtest-{secrets.token_hex(3)}", slots.take(), None)
    try:
        assert threads == ["network-builder"]
        assert network.name in namespaces() and network.slot is not None
    finally:
        await network.aclose()
    assert network.name not in namespaces()


async def test_a_cancelled_build_leaves_neither_namespace_nor_uplink(monkeypatch: pytest.MonkeyPatch):
    """The caller gives the slot back as soon as the cancellation reaches it: by then the network
    made meanwhile must be gone, or the next one on that slot would find its name taken."""
    underway, go_on = threading.Event(), threading.Event()
    make_tap = netns.make_tap

    def held(name: str) -> None:  # on the builder thread, until the build is cancelled
        underway.set()
        go_on.wait(10)
        make_tap(name)

    monkeypatch.setattr(netns, "make_tap", held)
    slot = SlotAllocator(*SLOTS).take()
    name = f"aenvtest-{secrets.token_hex(3)}"
    building = asyncio.create_task(builder.build(name, slot, None))
    assert await asyncio.to_thread(underway.wait, 10)
    building.cancel()
    await asyncio.sleep(0.05)
    assert not building.done()  # waits for the network it cannot stop
    go_on.set()
    with pytest.raises(asyncio.CancelledError):
        await building
    assert name not in namespaces() and slot.host_ifname not in root_links()
