"""The errors of the repository, whichever backend raises them.

Callers (the engine, the API's error mapping) catch these classes and never a backend's own
exceptions: a backend translates its store's failures (a missing file, an S3 404 or 412) into
one of them.
"""

from __future__ import annotations


class RepositoryError(Exception):
    """Base of every error the repository raises."""


class InvalidName(RepositoryError, ValueError):
    """An alias, snapshot id or lease holder does not follow the naming rules."""


class InvalidDigest(RepositoryError, ValueError):
    """A blob digest is not of the form ``sha256:<64 lowercase hex>``."""


class SnapshotNotFound(RepositoryError, LookupError):
    """No live snapshot has this id or alias."""


class SnapshotExists(RepositoryError):
    """A manifest with this id was already committed."""


class AliasConflict(RepositoryError):
    """The alias is bound to another live snapshot."""


class MissingBlob(RepositoryError):
    """A manifest names blobs the repository does not hold."""


class DigestMismatch(RepositoryError):
    """Bytes do not hash to the digest they were given or stored under."""


class SnapshotInUse(RepositoryError):
    """The snapshot is leased and the caller asked not to defer its deletion."""


class CorruptManifest(RepositoryError):
    """A stored manifest cannot be read (damaged, or written by a newer aenv)."""
