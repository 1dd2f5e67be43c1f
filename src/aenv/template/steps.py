"""The E2B template build document and what its steps mean, decided on the host.

The SDK sends a build as ``fromImage``/``fromTemplate`` plus ``steps`` (``COPY``, ``RUN``,
``ENV``, ``WORKDIR``, ``USER`` with string ``args``). This module validates that document,
computes each step's cache key (the layer below, the step, its files' hash: a forced step forces
every later one, as in E2B), and checks an uploaded ``COPY`` archive against the SDK's
``filesHash`` (hostile members refused) before the build VM's envd unpacks it
(``aenv.agent.envd.copying``).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
import stat
import tarfile
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from aenv.agent.envd import copying
from aenv.template.image import ImageError
from aenv.wiretypes import INTEGRAL

FILES_HASH = re.compile(r"^[0-9a-f]{64}$")
NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"  # a template name is a repository alias
TAG_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
# ``[namespace/]name[:tag]`` as the SDK sends template references
REFERENCE_PATTERN = r"^(?:[A-Za-z0-9._-]+/)?[a-z0-9][a-z0-9._-]{0,62}(?::[A-Za-z0-9][A-Za-z0-9._-]{0,127})?$"
DEFAULT_TAG = "default"
DEFAULT_USER = "user"  # E2B's templates run as `user` in /home/user unless a USER step says otherwise


class StepError(ImageError):
    """A step cannot run as written (bad arguments, missing or mismatching upload)."""


Tag = Annotated[str, StringConstraints(pattern=TAG_PATTERN)]


class _Wire(BaseModel):
    # Strict as the control plane's bodies: a wrong JSON type (`"cpuCount": "6"`) is a 400, not
    # quietly coerced.
    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)


class RegistryConfig(_Wire):
    type: Literal["registry", "aws", "gcp"]
    username: str | None = None
    password: str | None = None


class Step(_Wire):
    type: Literal["COPY", "RUN", "ENV", "WORKDIR", "USER"]
    args: list[str] = Field(default_factory=list, max_length=4096)
    files_hash: str | None = Field(default=None, alias="filesHash", pattern=FILES_HASH.pattern)
    force: bool = False

    @model_validator(mode="after")
    def _arity(self) -> Step:
        low = {"COPY": 2, "RUN": 1, "ENV": 2, "WORKDIR": 1, "USER": 1}[self.type]
        if len(self.args) < low:
            raise ValueError(f"{self.type} needs at least {low} argument(s)")
        if self.type == "ENV" and len(self.args) % 2:
            raise ValueError("ENV takes key and value pairs")
        if self.type == "COPY" and not self.files_hash:
            raise ValueError("COPY needs filesHash")
        return self


class BuildStart(_Wire):
    """``TemplateBuildStartV2``: where the build starts and what it runs."""

    from_image: str | None = Field(default=None, alias="fromImage", max_length=255)
    from_template: str | None = Field(default=None, alias="fromTemplate", max_length=255)
    from_image_registry: RegistryConfig | None = Field(default=None, alias="fromImageRegistry")
    force: bool = False
    steps: list[Step] = Field(default_factory=list, max_length=1000)
    start_cmd: str | None = Field(default=None, alias="startCmd")
    ready_cmd: str | None = Field(default=None, alias="readyCmd")

    @model_validator(mode="after")
    def _one_source(self) -> BuildStart:
        if (self.from_image is None) == (self.from_template is None):
            raise ValueError("give exactly one of fromImage and fromTemplate")
        if self.from_image_registry is not None and self.from_image_registry.type != "registry":
            raise ValueError(f"{self.from_image_registry.type} registries are not supported by this node")
        return self


class BuildRequest(_Wire):
    """``TemplateBuildRequestV3``: a name (``name[:tag]``), more tags, the machine's size."""

    name: str = Field(max_length=255, pattern=REFERENCE_PATTERN)
    tags: list[Tag] | None = Field(default=None, max_length=64)
    cpu_count: Annotated[int | None, INTEGRAL] = Field(default=None, alias="cpuCount", ge=1, le=64)
    memory_mb: Annotated[int | None, INTEGRAL] = Field(default=None, alias="memoryMB", ge=128, le=65536)
    min_free_disk_mb: Annotated[int | None, INTEGRAL] = Field(default=None, alias="minFreeDiskMb", ge=0)


class TagsRequest(_Wire):
    """``AssignTemplateTagsRequest`` (``target`` is ``name:tag``)."""

    target: str = Field(max_length=255, pattern=REFERENCE_PATTERN)
    tags: list[Tag] = Field(min_length=1, max_length=64)


class UntagRequest(_Wire):
    """``DeleteTemplateTagsRequest``."""

    name: str = Field(max_length=255, pattern=REFERENCE_PATTERN)
    tags: list[Tag] = Field(min_length=1, max_length=64)


def split_name(reference: str) -> tuple[str, str | None]:
    """``[namespace/]name[:tag]`` as (name, tag or None); the name must be a valid alias."""
    name, _, tag = reference.rsplit("/", 1)[-1].partition(":")
    if not re.match(NAME_PATTERN, name):
        raise StepError(
            f"invalid template name {name!r}: 1-63 characters of a-z, 0-9, '.', '_', '-', "
            "starting with a letter or digit"
        )
    if tag and not re.match(TAG_PATTERN, tag):
        raise StepError(f"invalid tag {tag!r}")
    return name, tag or None


# -- the state steps carry --------------------------------------------------------------------


@dataclass(frozen=True)
class BuildState:
    """What later steps and the finished template inherit: ENV, USER and WORKDIR so far."""

    env: dict[str, str] = field(default_factory=dict)
    user: str = DEFAULT_USER
    workdir: str = f"/home/{DEFAULT_USER}"

    def to_json(self) -> str:
        return json.dumps({"env": self.env, "user": self.user, "workdir": self.workdir}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> BuildState:
        data = json.loads(text)
        return cls(env=dict(data["env"]), user=data["user"], workdir=data["workdir"])

    def with_env(self, env: dict[str, str]) -> BuildState:
        return replace(self, env={**self.env, **env})

    def path(self, raw: str) -> str:
        """A step's path argument made absolute against the current workdir."""
        return posixpath.normpath(posixpath.join(self.workdir, raw))


def step_key(parent: str, step: Step) -> str:
    """The cache key of a step's layer: the layer below, the step itself, its files' hash."""
    document = json.dumps([parent, step.type, step.args, step.files_hash or ""])
    return hashlib.sha256(document.encode()).hexdigest()


def first_forced(start: BuildStart) -> int:
    """Index of the first step that must run even if cached (len(steps) if none must)."""
    if start.force:
        return 0
    return next((i for i, step in enumerate(start.steps) if step.force), len(start.steps))


def step_name(index: int) -> str:
    """How the SDK names steps in a failure's ``reason.step``: 1-based numbers."""
    return str(index + 1)


def expand_command(value: str) -> str:
    """A shell command printing ``value`` expanded as inside double quotes (E2B's ENV semantics)."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`")
    return f'printf %s "{escaped}"'


# -- COPY -----------------------------------------------------------------------------------

# Bytes an upload may unpack to: with the archive streamed, the bound is on the work a gzip
# bomb makes (hashing here, writing in the build VM), no longer on the node's memory.
MAX_UNPACKED = 8 << 30
HASH_CHUNK = 1 << 20


def verified_roots(upload: Path, step: Step) -> list[tuple[str, bool]]:
    """Check a COPY's upload against its ``filesHash`` in one pass over the file, refusing
    hostile members (``copying.check``); the members its source named (``copying.roots``).

    The SDK's ``calculate_files_hash``, recomputed: the step, then each member's name and, for a
    file, its mode, size and content (a hard link's are its target's), a link its target.
    Nothing is held but the members' names. Measured with a 200 MiB COPY from `base` (TCG):
    the node's peak RSS went from 101 MiB before the build to 109 MiB (1,119 MiB when the
    archive was inflated and rewritten in memory).
    """
    digest = hashlib.sha256(f"COPY {step.args[0]} {step.args[1]}".encode())
    entries: list[tuple[str, bool]] = []
    unpacked = 0
    try:
        with tarfile.open(upload, mode="r|*", bufsize=HASH_CHUNK) as archive, _Targets(upload) as targets:
            for member in archive:
                if len(entries) >= copying.MAX_MEMBERS:
                    raise StepError(f"the uploaded archive has more than {copying.MAX_MEMBERS} members")
                copying.check(member)
                entries.append((member.name, member.isdir()))
                digest.update(member.name.encode())
                if member.issym():
                    target = member.linkname.encode()
                    digest.update(str(stat.S_IFLNK | 0o777).encode() + str(len(target)).encode() + target)
                elif member.isdir():
                    digest.update(str(stat.S_IFDIR | member.mode).encode())
                else:
                    size, content = targets.content(member.linkname) if member.islnk() else (
                        member.size, archive.extractfile(member)
                    )  # fmt: skip
                    unpacked += size
                    if unpacked > MAX_UNPACKED:
                        raise StepError(f"the uploaded files unpack to more than {MAX_UNPACKED >> 20} MiB")
                    digest.update(str(stat.S_IFREG | member.mode).encode() + str(size).encode())
                    while content is not None and (chunk := content.read(HASH_CHUNK)):
                        digest.update(chunk)
    except copying.CopyError as exc:
        raise StepError(str(exc)) from None
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise StepError(f"the uploaded files are not a valid tar archive: {exc}") from None
    if digest.hexdigest() != step.files_hash:
        raise StepError(f"the files uploaded for COPY {step.args[0]} do not match their hash")
    return copying.roots(entries)


class _Targets:
    """Hard links' targets, read again from the upload (a pass over the archive per link: the
    SDK only writes hard links for files linked in the build context, which is rare)."""

    def __init__(self, upload: Path):
        self.upload = upload
        self.archive: tarfile.TarFile | None = None

    def __enter__(self) -> _Targets:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.archive is not None:
            self.archive.close()

    def content(self, name: str) -> tuple[int, IO[bytes] | None]:
        if self.archive is None:
            self.archive = tarfile.open(self.upload)  # noqa: SIM115 (closed by __exit__)
        try:
            member = self.archive.getmember(name)
        except KeyError:
            raise StepError(f"the uploaded archive holds a hard link to a missing {name!r}") from None
        return member.size, self.archive.extractfile(member)


def parse_mode(raw: str) -> int | None:
    """COPY's mode argument: empty, or octal digits."""
    if not raw:
        return None
    if not re.fullmatch(r"[0-7]{1,4}", raw):
        raise StepError(f"invalid COPY mode {raw!r}: octal digits expected")
    return int(raw, 8)
