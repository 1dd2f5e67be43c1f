"""The repository's names and their validators: digests, snapshot and layer ids, aliases, holders.

Every name a backend turns into a file or an object key is checked here first, so that no
caller's string can reach outside its directory or prefix.
"""

from __future__ import annotations

import re
import socket

from .errors import InvalidDigest, InvalidName

DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
SNAPSHOT_ID_RE = re.compile(r"[a-z0-9]{1,64}")
LAYER_ID_RE = re.compile(r"[a-z0-9]{1,128}")
ALIAS_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
HOLDER_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
DIGEST_ANYWHERE = re.compile(r"sha256:[0-9a-f]{64}")


def default_node_id() -> str:
    """This host's name as a lease owner, for repositories used by one node per host."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64] or "local"


def check_alias(alias: str) -> str:
    """Return ``alias`` if it is a valid alias name, else raise ``InvalidName``."""
    if not isinstance(alias, str) or not ALIAS_RE.fullmatch(alias):
        raise InvalidName(
            f"invalid alias {alias!r}: use 1-63 characters of a-z, 0-9, '.', '_', '-', "
            "starting with a letter or digit"
        )
    return alias


def check_digest(digest: str) -> str:
    if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
        raise InvalidDigest(f"invalid digest {digest!r}: expected 'sha256:<64 lowercase hex>'")
    return digest


def check_holder(holder: str) -> str:
    if not isinstance(holder, str) or not HOLDER_RE.fullmatch(holder):
        raise InvalidName(f"invalid lease holder {holder!r}: use letters, digits, '.', '_', '-'")
    return holder


def check_snapshot_id(snapshot_id: str) -> str:
    if not isinstance(snapshot_id, str) or not SNAPSHOT_ID_RE.fullmatch(snapshot_id):
        raise InvalidName(f"invalid snapshot id {snapshot_id!r}")
    return snapshot_id
