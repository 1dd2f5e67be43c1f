"""Mutable daemon-wide configuration, set from the command line and by `POST /init`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class State:
    default_user: str = "user"
    default_workdir: str | None = None
    access_token: str | None = None
    # The node's side of the tap: /init from there may replace the token without presenting it,
    # as restored and forked guests carry their source's token (the node's proxy refuses /init).
    host_peer: str | None = None
    env_vars: dict[str, str] = field(default_factory=dict)
