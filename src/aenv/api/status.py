"""The one place where kinds of failure become HTTP statuses, for the node's API and for the
clients that read its answers back into kinds (`aenv.cluster.client`)."""

from __future__ import annotations

from ..orchestrator.errors import (
    BadGuest,
    Conflict,
    Forbidden,
    InsufficientStorage,
    InvalidRequest,
    NotFound,
    OperationFailed,
    Overloaded,
    SandboxError,
    Unavailable,
)

STATUS: dict[type[SandboxError], int] = {
    InvalidRequest: 400,
    Forbidden: 403,
    NotFound: 404,
    Conflict: 409,
    Overloaded: 429,  # before Unavailable, of which it is a kind: the first match is the status
    Unavailable: 503,
    InsufficientStorage: 507,
    BadGuest: 502,
    OperationFailed: 500,
}


def status_of(error: SandboxError) -> int:
    return next(code for kind, code in STATUS.items() if isinstance(error, kind))
