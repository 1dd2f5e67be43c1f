"""The warm pool's bookkeeping against a fake source: targets, refills, refreshes, taking and
draining (no VMs)."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any, cast

from aenv.snapshot.warm_pool import WarmPool, WarmVM


class FakeSource:
    """Makes numbered stand-ins for warm VMs and remembers which were discarded."""

    def __init__(self, fail: bool = False, refresh_fails: bool = False):
        self.fail = fail
        self.refresh_fails = refresh_fails
        self.discarded: list[str] = []
        self.refreshed: list[str] = []
        self.refreshing = asyncio.Event()  # set while a refresh waits for `proceed`
        self.proceed = asyncio.Event()
        self.proceed.set()
        self._ids = itertools.count()

    async def spawn(self, snapshot_id: str) -> WarmVM:
        await asyncio.sleep(0)
        if self.fail:
            raise RuntimeError("snapshot cannot run here")
        fake = cast(Any, None)
        return WarmVM(f"w{next(self._ids)}", snapshot_id, fake, fake, fake, "ltop", Path("/nonexistent"))

    async def refresh(self, warm: WarmVM) -> None:
        self.refreshing.set()
        await self.proceed.wait()
        self.refreshing.clear()
        if self.refresh_fails:
            raise RuntimeError("guest stopped answering")
        self.refreshed.append(warm.entry_id)

    async def discard(self, warm: WarmVM) -> None:
        self.discarded.append(warm.entry_id)


def test_refills_to_target_and_hands_out_ready_vms() -> None:
    source = FakeSource()

    async def main() -> None:
        pool = WarmPool(source)
        await pool.set_target("s1", 2)
        await pool.wait_filled("s1")
        assert pool.ready("s1") == 2
        taken = pool.take("s1")
        assert taken is not None and taken.snapshot_id == "s1" and pool.ready("s1") == 1
        assert pool.take("other") is None
        pool.refill("s1")
        await pool.wait_filled("s1")
        assert pool.ready("s1") == 2
        await pool.set_target("s1", 1)
        assert pool.ready("s1") == 1 and len(source.discarded) == 1
        await pool.close()
        assert pool.ready("s1") == 0 and len(source.discarded) == 2

    asyncio.run(main())


def test_a_failing_source_stops_the_refill_without_raising() -> None:
    async def main() -> None:
        pool = WarmPool(FakeSource(fail=True))
        await pool.set_target("s1", 2)
        await pool.wait_filled("s1")
        assert pool.ready("s1") == 0 and pool.target("s1") == 2
        await pool.drain("s1")

    asyncio.run(main())


async def held_in_refresh(source: FakeSource) -> WarmPool:
    """A pool of one warm VM for `s1`, refreshed every 50 ms, whose VM is in its first refresh
    until the test sets `source.proceed`."""
    pool = WarmPool(source, refresh_interval=0.05)
    await pool.set_target("s1", 1)
    await pool.wait_filled("s1")
    source.proceed.clear()
    await asyncio.wait_for(source.refreshing.wait(), 5)
    return pool


def test_waiting_vms_are_refreshed_and_cannot_be_taken_meanwhile() -> None:
    """Each VM that waited an interval is refreshed out of the ready list, then returned to it;
    one that fails its refresh is discarded and replaced."""
    source = FakeSource()

    async def main() -> None:
        pool = await held_in_refresh(source)
        assert pool.ready("s1") == 0 and pool.take("s1") is None
        before = time.monotonic()
        source.proceed.set()
        while not source.refreshed:
            await asyncio.sleep(0.01)
        warm = pool.take("s1")
        assert warm is not None and warm.refreshed >= before and source.discarded == []
        source.refresh_fails = True
        pool.refill("s1")
        await pool.wait_filled("s1")
        while not source.discarded:
            await asyncio.sleep(0.01)
        source.refresh_fails = False
        while pool.ready("s1") == 0:
            await asyncio.sleep(0.01)
        await pool.close()

    asyncio.run(main())


def test_closing_discards_a_vm_in_the_middle_of_its_refresh() -> None:
    source = FakeSource()

    async def main() -> None:
        pool = await held_in_refresh(source)
        await pool.close()
        assert source.discarded == ["w0"] and pool.ready("s1") == 0

    asyncio.run(main())
