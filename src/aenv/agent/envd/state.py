"""Mutable daemon-wide configuration, set from the command line and by `POST /init`.

What `/init` set can be kept in a root-only file (the guest's init names one on the /run tmpfs),
so that an envd restarted after a crash keeps the sandbox's access token, environment and
defaults instead of coming back open to anyone and without the sandbox's variables.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

# What `/init` sets, with the types a saved value must have to be taken back (a saved None
# token is one the node took away: it must not come back as the one envd was started with).
PERSISTED: dict[str, type | tuple[type, ...]] = {
    "default_user": str,
    "default_workdir": str,
    "access_token": (str, type(None)),
    "env_vars": dict,
}


def same_secret(sent: str, expected: str) -> bool:
    """Constant-time comparison of a client-sent secret (any characters) with the expected one."""
    return hmac.compare_digest(
        sent.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass")
    )


@dataclass
class State:
    exec_helper: str  # aenv-exec (built from aenv/agent/exec.c), which starts every command
    default_user: str = "user"
    default_workdir: str | None = None
    access_token: str | None = None
    # The node's side of the tap: /init from there may replace the token without presenting it,
    # as restored and forked guests carry their source's token (the node's proxy refuses /init).
    host_peer: str | None = None
    env_vars: dict[str, str] = field(default_factory=dict)
    store: Path | None = None

    def persisted(self) -> dict[str, object]:
        """What `save` keeps."""
        return {name: getattr(self, name) for name in PERSISTED}

    def save(self) -> None:
        """Write the `/init` settings to the store (atomically, readable by root only)."""
        if self.store is None:
            return
        data = memoryview(json.dumps(self.persisted()).encode())
        tmp = self.store.with_name(self.store.name + ".tmp")
        try:
            fd = self._open(tmp)
            try:
                while data:
                    data = data[os.write(fd, data) :]
            finally:
                os.close(fd)
            os.replace(tmp, self.store)
        except OSError as e:
            log.warning("cannot keep the sandbox settings in %s: %s", self.store, e)

    def _open(self, path: Path) -> int:
        """`path` created for writing, its directory too if need be. Plain `os` calls: under TCG
        a `mkdir` that finds the directory and a buffered file object cost the guest ~1 ms."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            return os.open(path, flags, 0o600)
        except FileNotFoundError:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            return os.open(path, flags, 0o600)

    def restore(self) -> None:
        """Take over the settings a previous envd saved, if there are any."""
        if self.store is None:
            return
        try:
            data = json.loads(self.store.read_bytes())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            log.warning("ignoring unreadable sandbox settings in %s: %s", self.store, e)
            return
        if not isinstance(data, dict):
            return
        for name, kind in PERSISTED.items():
            if name in data and isinstance(data[name], kind):
                setattr(self, name, data[name])
        log.info("restored the sandbox settings from %s", self.store)
