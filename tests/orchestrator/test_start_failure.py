"""A create whose guest never answered is a retryable 503; any other failure stays a 500."""

from __future__ import annotations

from aenv.orchestrator.errors import OperationFailed, Unavailable
from aenv.orchestrator.failures import start_failure
from aenv.vmm.envd_link import EnvdUnavailable


def test_a_starved_guest_is_reported_as_an_overloaded_node() -> None:
    for exc in (TimeoutError("timed out"), EnvdUnavailable("envd did not answer /health within 5 s")):
        error = start_failure(exc)
        assert isinstance(error, Unavailable)
        assert "overloaded" in error.message


def test_other_failures_are_failed_operations() -> None:
    error = start_failure(RuntimeError("envd /init answered 500"))
    assert isinstance(error, OperationFailed)
    assert error.message == "creating the sandbox failed: envd /init answered 500"
