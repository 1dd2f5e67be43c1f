"""EnvdLink.init's retries, with the guest's HTTP exchange replaced by a script of outcomes."""

from __future__ import annotations

import asyncio

import pytest

from aenv.vmm.envd_link import EnvdLink


class ScriptedLink(EnvdLink):
    def __init__(self, outcomes: list[BaseException | tuple[int, bytes]]):
        super().__init__(network=None)  # type: ignore[arg-type]
        self.outcomes = outcomes
        self.timestamps: list[str] = []

    async def _request(self, method, path, *, body=b"", headers=None, timeout=5.0):
        import json

        self.timestamps.append(json.loads(body)["timestamp"])
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def test_init_retries_an_unreachable_guest_with_a_fresh_clock() -> None:
    link = ScriptedLink([OSError(113, "No route to host"), ConnectionRefusedError(), (204, b"")])
    asyncio.run(link.init({"timestamp": "2000-01-01T00:00:00Z"}, timeout=5))
    assert len(link.timestamps) == 3 and "2000-01-01T00:00:00Z" not in link.timestamps
    assert link.timestamps == sorted(link.timestamps)


def test_init_does_not_retry_past_its_timeout_or_a_timed_out_request() -> None:
    with pytest.raises(TimeoutError):
        asyncio.run(ScriptedLink([TimeoutError(), (204, b"")]).init({"timestamp": "x"}, timeout=5))
    with pytest.raises(ConnectionRefusedError):
        asyncio.run(ScriptedLink([ConnectionRefusedError()] * 100).init({"timestamp": "x"}, timeout=0.2))
    with pytest.raises(RuntimeError, match="answered 401"):
        asyncio.run(ScriptedLink([(401, b"no")]).init({"timestamp": "x"}, timeout=5))
