"""The engine's failures as the node service's error kinds, mapped once for every job.

`ENGINE_FAILURES` is what the engine raises when an operation fails for a reason outside this
process's code: QEMU, QMP, envd, networking, the disk or a damaged saved state. Anything else is
a bug, left to the API's error boundary (logged with its traceback, answered as an internal
error).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from ..repository.errors import AliasConflict, InvalidName, RepositoryError, SnapshotExists
from ..snapshot.checkpoints import CheckpointConflict, CheckpointNotFound, InvalidCheckpoint
from ..vmm.envd_link import EnvdUnavailable
from .errors import Conflict, InvalidRequest, NotFound, OperationFailed, SandboxError, Unavailable

log = logging.getLogger(__name__)

ENGINE_FAILURES = (RuntimeError, OSError, ValueError, RepositoryError)


@contextlib.contextmanager
def engine_errors(what: str) -> Iterator[None]:
    """The snapshot engine's refusals and failures of a snapshot, checkpoint or reset as the node
    service's kinds; `what` names the operation in a failure's message."""
    try:
        yield
    except (InvalidName, InvalidCheckpoint) as exc:
        raise InvalidRequest(str(exc)) from exc
    except (AliasConflict, SnapshotExists, CheckpointConflict) as exc:
        raise Conflict(str(exc)) from exc
    except CheckpointNotFound as exc:
        raise NotFound(str(exc)) from exc
    except ENGINE_FAILURES as exc:
        log.warning("%s failed: %s", what, exc)
        raise OperationFailed(f"{what} failed: {exc}") from exc


def start_failure(exc: Exception) -> SandboxError:
    """What a client is told when a new sandbox did not start.

    A guest that did not answer in time was starved of CPU (a saturated node, under TCG most
    often): nothing is wrong with the request, and the same create succeeds once the node has
    room, so that is a retryable 503 rather than a 500."""
    if isinstance(exc, TimeoutError | EnvdUnavailable):
        return Unavailable(f"the sandbox's guest did not answer in time, the node is overloaded: {exc}")
    return OperationFailed(f"creating the sandbox failed: {exc}")
