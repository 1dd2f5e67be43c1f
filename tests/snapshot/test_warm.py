"""A warm VM's rehearsal command, against a fake envd link (no VMs)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from aenv.snapshot.warm import REHEARSAL, rehearse


class FakeEnvd:
    """Records the commands it is asked to run; answers each with `outcome`."""

    def __init__(self, outcome: BaseException | int):
        self.outcome = outcome
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def run(self, cmd: str, **options: Any) -> int | None:
        self.calls.append((cmd, options))
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


def test_the_rehearsal_runs_as_the_default_user_like_an_sdk_command() -> None:
    envd = FakeEnvd(0)
    asyncio.run(rehearse(cast(Any, envd)))
    [(cmd, options)] = envd.calls
    assert cmd == REHEARSAL and options["user"] is None and not options.get("background")


@pytest.mark.parametrize("outcome", [127, RuntimeError("envd Start failed: no such user")])
def test_an_image_that_cannot_run_it_still_gives_a_warm_vm(outcome: BaseException | int) -> None:
    asyncio.run(rehearse(cast(Any, FakeEnvd(outcome))))


def test_a_guest_that_does_not_answer_is_not_handed_out() -> None:
    with pytest.raises(TimeoutError):
        asyncio.run(rehearse(cast(Any, FakeEnvd(TimeoutError()))))
