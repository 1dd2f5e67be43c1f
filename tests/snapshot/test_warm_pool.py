"""The warm pool's bookkeeping against a fake source: targets, refills, taking and draining (no VMs)."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any, cast

from aenv.snapshot.warm_pool import WarmPool, WarmVM


class FakeSource:
    """Makes numbered stand-ins for warm VMs and remembers which were discarded."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.discarded: list[str] = []
        self._ids = itertools.count()

    async def spawn(self, snapshot_id: str) -> WarmVM:
        await asyncio.sleep(0)
        if self.fail:
            raise RuntimeError("snapshot cannot run here")
        fake = cast(Any, None)
        return WarmVM(f"w{next(self._ids)}", snapshot_id, fake, fake, fake, "ltop", Path("/nonexistent"))

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
