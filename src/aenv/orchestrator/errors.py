"""What a node operation can refuse or fail with, by kind rather than by HTTP status.

The orchestrator and the node service raise these; the HTTP layer maps each kind to a status in
one table (`aenv.api.status.STATUS`), and a gateway can map them the same way, so the same
situation always gets the same answer whichever operation met it.
"""

from __future__ import annotations

# The `error_code` of a Conflict for a call that needs a shared repository, on a node whose
# repository is its own (posix): such a node cannot help, and a gateway asks another.
NOT_SHARED = "repository_not_shared"
# The `error_code` of a take-over's NotFound: the durable pause is gone from the repository, or
# its own node claimed it back. That node resumed or ended the sandbox after it last reported
# the pause durable, so a gateway that finds this node down knows the sandbox was lost with it.
PAUSE_GONE = "pause_gone"
SNAPSHOT_PENDING = "snapshot_pending"  # another node answered the snapshot and is still committing it


class SandboxError(Exception):
    """A refused or failed operation; `message` is what the client is told."""

    def __init__(self, message: str, error_code: str | None = None):
        super().__init__(message)
        self.message = message
        self.error_code = error_code


class InvalidRequest(SandboxError):
    """The request itself is wrong (a value out of range, a name that cannot be used)."""


class Forbidden(SandboxError):
    """The request's credentials do not allow it (an upload URL with a bad signature, expired)."""


class NotFound(SandboxError):
    """No such sandbox, template or snapshot (or none in a state the operation can see)."""


class Conflict(SandboxError):
    """The target exists but its state does not allow the operation now."""


class Unavailable(SandboxError):
    """The node cannot take the operation now (capacity, shutting down); retrying later may work."""


class Overloaded(Unavailable):
    """No room for it right now (guest RAM, network slots; on a gateway: every node full), though
    nothing is wrong: E2B's 429 with `Retry-After`, which the E2B SDKs retry on their own (its
    Python SDK 3 times by default, waiting `Retry-After` seconds)."""

    retry_after = 1  # seconds: E2B's clients take whole seconds; sandboxes end and free room that fast


def parse_retry_after(value: str | None, default: int) -> int:
    """A Retry-After of whole seconds as E2B's SDKs read it; `default` for anything else."""
    return int(value) if value is not None and value.isascii() and value.isdecimal() else default


class OperationFailed(SandboxError):
    """The node tried and failed; the state the API reports afterwards is the truth."""


class InsufficientStorage(SandboxError):
    """The node's disk is below its free-space reserve: nothing that writes state is started."""


class BadGuest(SandboxError):
    """The sandbox's own guest broke a bound the node holds it to (answered too much, too slowly,
    or not as envd does); `error_code` says which. Only that sandbox's call fails."""
