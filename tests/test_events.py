"""The event bus: subscribers by type in order; `publish` refuses a subscriber that awaits."""

from __future__ import annotations

import asyncio

import pytest

from aenv.events import EventBus, SandboxChanged, SandboxStopped, TemplateBuilt


def test_subscribers_get_their_type_in_the_order_they_subscribed() -> None:
    bus, seen = EventBus(), []
    bus.subscribe(SandboxChanged, lambda e: seen.append(("first", e.sandbox_id)))
    bus.subscribe(SandboxChanged, lambda e: seen.append(("second", e.sandbox_id)))
    bus.subscribe(SandboxStopped, lambda e: seen.append(("stopped", e.sandbox_id)))
    bus.publish(SandboxChanged("a"))
    assert seen == [("first", "a"), ("second", "a")]


def test_deliver_awaits_coroutine_subscribers_and_publish_refuses_them() -> None:
    bus, built = EventBus(), []

    async def keep_warm(event: TemplateBuilt) -> None:
        await asyncio.sleep(0)
        built.append(event.snapshot_id)

    bus.subscribe(TemplateBuilt, keep_warm)
    asyncio.run(bus.deliver(TemplateBuilt("t1", ("t0",))))
    assert built == ["t1"]
    with pytest.raises(TypeError, match="delivered, not published"):
        bus.publish(TemplateBuilt("t2"))
