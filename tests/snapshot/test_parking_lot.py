"""The parking lot's bookkeeping: by count, by age, and after it closed (no VMs needed)."""

from __future__ import annotations

import asyncio
import threading

from aenv.snapshot.parking import ParkedVM, ParkingLot, ParkingPolicy


def parked(sandbox, capture: asyncio.Future[None]) -> ParkedVM:
    """A parked sandbox as the lot sees it (its capture already done)."""
    return ParkedVM(sandbox, capture, threading.Event(), asyncio.Event())  # type: ignore[arg-type]


def run_lot(policy: ParkingPolicy, scenario) -> list[str]:
    released: list[str] = []

    async def release(parked: ParkedVM) -> None:
        released.append(parked.sandbox)

    async def main() -> None:
        lot = ParkingLot(policy, release)
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        await scenario(lot, lambda name: lot.park(name, parked(name, done)))
        await lot.close()

    asyncio.run(main())
    return released


def test_oldest_goes_first_when_over_count() -> None:
    async def scenario(lot, park):
        for name in ("a", "b", "c"):
            park(name)
        await asyncio.sleep(0)
        assert "a" not in lot and "b" in lot and "c" in lot
        assert lot.take("b") is not None and "b" not in lot

    assert run_lot(ParkingPolicy(max_seconds=60, max_count=2, min_available=0), scenario) == ["a", "c"]


def test_kept_processes_end_after_their_time() -> None:
    async def scenario(lot, park):
        park("a")
        await asyncio.sleep(0.1)
        assert "a" not in lot

    assert run_lot(ParkingPolicy(max_seconds=0.05, max_count=8, min_available=0), scenario) == ["a"]


def test_nothing_is_kept_once_closed() -> None:
    async def scenario(lot, park):
        await lot.close()
        assert not lot.accepts()
        park("late")
        assert "late" not in lot

    assert run_lot(ParkingPolicy(max_seconds=60, max_count=8, min_available=0), scenario) == ["late"]


def test_the_lot_names_its_kept_processes() -> None:
    class Kept:  # what the lot reads of a parked sandbox: its QEMU's pid
        def __init__(self, pid: int) -> None:
            self.vm = type("VM", (), {"pid": pid})()

    async def main() -> set[int]:
        async def release(parked: ParkedVM) -> None:
            pass

        lot = ParkingLot(ParkingPolicy(max_seconds=60, max_count=4, min_available=0), release)
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        for name, pid in (("a", 101), ("b", 102)):
            lot.park(name, parked(Kept(pid), done))
        lot.take("a")
        pids = lot.pids()
        await lot.close()
        return pids

    assert asyncio.run(main()) == {102}


def test_closing_waits_for_the_captures_of_sandboxes_taken_from_the_lot() -> None:
    """A resume takes its sandbox without waiting for the capture's flush; the node's shutdown
    must not end before that capture has discarded its file."""

    async def main() -> list[str]:
        events: list[str] = []

        async def release(parked: ParkedVM) -> None:
            pass

        async def capture() -> None:
            await asyncio.sleep(0.05)
            events.append("capture ended")

        lot = ParkingLot(ParkingPolicy(max_seconds=60, max_count=4, min_available=0), release)
        lot.park("a", parked("a", asyncio.create_task(capture())))
        assert lot.take("a") is not None
        await lot.close()
        events.append("closed")
        return events

    assert asyncio.run(main()) == ["capture ended", "closed"]
