"""Docker image references (``[registry[:port]/]repository[:tag][@digest]``), parsed strictly.

A reference decides which host aenv connects to and whether plain HTTP is allowed there, so it
is parsed with the grammar of the reference implementation (distribution/reference) rather than
split ad hoc: ``ubuntu`` means ``docker.io/library/ubuntu:latest``, and only a first component
with a ``.`` or ``:`` (or ``localhost``) names a registry.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from aenv.template.image import InvalidReference

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"  # where docker.io's v2 API actually lives
_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_REGISTRY = re.compile(
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9-]+)*|\[[0-9A-Fa-f:.]+\])(?::\d+)?"
)
_TAG = re.compile(r"[\w][\w.-]{0,127}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
MAX_LENGTH = 255


@dataclass(frozen=True)
class Reference:
    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def ref(self) -> str:
        """What the manifest endpoint is asked for: the digest if pinned, else the tag."""
        return self.digest or self.tag or "latest"

    @property
    def api_host(self) -> str:
        return DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    def __str__(self) -> str:
        text = f"{self.registry}/{self.repository}"
        if self.tag:
            text += f":{self.tag}"
        return text + (f"@{self.digest}" if self.digest else "")


def parse_reference(text: str) -> Reference:
    """Parse a reference; the tag defaults to ``latest`` unless a digest pins the image."""
    if not isinstance(text, str) or not text or len(text) > MAX_LENGTH:
        raise InvalidReference(f"invalid image reference {text!r}")
    name, _, digest = text.partition("@")
    if digest and not _DIGEST.fullmatch(digest):
        raise InvalidReference(f"invalid digest in image reference {text!r} (expected sha256:<64 hex>)")
    tag = None
    slash = name.rfind("/")
    if ":" in name[slash + 1 :]:
        name, _, tag = name.rpartition(":")
        if not _TAG.fullmatch(tag):
            raise InvalidReference(f"invalid tag in image reference {text!r}")
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, rest
        if not _REGISTRY.fullmatch(registry):
            raise InvalidReference(f"invalid registry in image reference {text!r}")
    else:
        registry, path = DOCKER_HUB, name
    if registry == DOCKER_HUB and "/" not in path:
        path = f"library/{path}"
    if not all(_COMPONENT.fullmatch(c) for c in path.split("/")):
        raise InvalidReference(
            f"invalid repository in image reference {text!r}: lowercase letters, digits and separators"
        )
    return Reference(registry, path, tag if tag or digest else "latest", digest or None)


def is_loopback(registry: str) -> bool:
    """Whether a registry ``host[:port]`` is on this machine (the only place plain HTTP is allowed)."""
    if registry.startswith("["):
        return is_loopback_host(registry[1:].partition("]")[0])
    return is_loopback_host(registry.rpartition(":")[0] or registry)


def is_loopback_host(host: str) -> bool:
    """Whether a bare host name or IP literal is this machine; names other than localhost are not."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
