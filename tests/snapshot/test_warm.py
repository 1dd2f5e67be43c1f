"""A warm VM's rehearsal (a command, a file written and removed), against a fake envd link, and
which creates take a warm VM as it is (no VMs)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, cast

import pytest

from aenv.snapshot.model import GuestInit
from aenv.snapshot.warm import CLOCK_FRESH, REHEARSAL, adoptable, rehearse
from aenv.snapshot.warm_pool import WarmVM


class FakeEnvd:
    """Records what it is asked to do; answers commands with the exit codes in `codes` (or raises
    one that is an exception) and uploads with `upload` (None: accepted)."""

    def __init__(self, *codes: BaseException | int, upload: BaseException | None = None):
        self.codes = list(codes)
        self.upload = upload
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    async def run(self, cmd: str, **options: Any) -> int | None:
        self.calls.append(("run", cmd, options))
        outcome = self.codes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def write_file(self, path: str, data: bytes, **options: Any) -> None:
        self.calls.append(("write", path, options))
        if self.upload is not None:
            raise self.upload


def rehearsed(envd: FakeEnvd) -> list[tuple[str, str, dict[str, Any]]]:
    asyncio.run(rehearse(cast(Any, envd)))
    return envd.calls


def test_the_rehearsal_runs_and_writes_as_the_default_user_and_leaves_no_file() -> None:
    (_, first, options), (_, path, upload), (_, remove, _) = rehearsed(FakeEnvd(0, 0))
    assert first == REHEARSAL and options["user"] is None and not options.get("background")
    assert path.startswith("/tmp/.aenv-rehearsal-") and upload["user"] is None and upload["form"]
    assert remove == f"rm -f {path}"


@pytest.mark.parametrize("outcome", [127, RuntimeError("envd Start failed: no such user")])
def test_an_image_that_cannot_run_a_command_still_gives_a_warm_vm(outcome: BaseException | int) -> None:
    assert [kind for kind, _, _ in rehearsed(FakeEnvd(outcome))] == ["run"]


def test_a_refused_upload_is_still_cleaned_up() -> None:
    calls = rehearsed(FakeEnvd(0, 0, upload=RuntimeError("envd /files answered 403")))
    assert [kind for kind, _, _ in calls] == ["run", "write", "run"]


def test_a_guest_that_keeps_the_file_or_does_not_answer_is_not_handed_out() -> None:
    with pytest.raises(RuntimeError, match="could not remove"):
        rehearsed(FakeEnvd(0, 1))
    with pytest.raises(TimeoutError):
        rehearsed(FakeEnvd(TimeoutError()))


def test_a_secured_create_without_variables_takes_a_fresh_warm_vm_as_it_is() -> None:
    """No `/init` for a create that asks for nothing but a token, of a VM whose clock is fresh;
    one for variables, an unsecured sandbox (its guest must drop the token), or a stale clock."""
    fake = cast(Any, None)
    warm = WarmVM("w0", "s1", fake, fake, fake, "ltop", Path("/nonexistent"), "warm-token")
    assert adoptable(warm, GuestInit(access_token="t"))
    assert not adoptable(warm, GuestInit(access_token="t", env_vars={"A": "1"}))
    assert not adoptable(warm, GuestInit())
    assert not adoptable(warm, GuestInit(access_token="t", default_user="root"))
    warm.refreshed = time.monotonic() - CLOCK_FRESH - 1
    assert not adoptable(warm, GuestInit(access_token="t"))
