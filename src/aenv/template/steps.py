"""The E2B template build document and what its steps mean, decided on the host.

The SDK sends a build as ``fromImage``/``fromTemplate`` plus ``steps`` (``COPY``, ``RUN``,
``ENV``, ``WORKDIR``, ``USER`` with string ``args``). This module validates that document,
computes each step's cache key (the layer below, the step, its files' hash: a forced step forces
every later one, as in E2B), and turns an uploaded ``COPY`` archive into the plain tar the build
VM extracts at ``/``: its content checked against the SDK's ``filesHash``, hostile members
refused, paths mapped with Docker's ``COPY`` rules and owner and mode applied.
"""

from __future__ import annotations

import hashlib
import io
import json
import posixpath
import re
import stat
import tarfile
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

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

MAX_MEMBERS = 200_000
MAX_UNPACKED = 1 << 30


def read_archive(data: bytes) -> tarfile.TarFile:
    """Open an uploaded tar (gzip or plain); a broken or oversized one is a ``StepError``."""
    try:
        raw = data
        if data[:2] == b"\x1f\x8b":
            inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
            raw = inflate.decompress(data, MAX_UNPACKED)
            if inflate.unconsumed_tail:
                raise StepError(f"the uploaded files unpack to more than {MAX_UNPACKED >> 20} MiB")
        archive = tarfile.open(fileobj=io.BytesIO(raw), mode="r:")  # noqa: SIM115 (in memory)
        archive.getmembers()
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise StepError(f"the uploaded files are not a valid tar archive: {exc}") from None
    return archive


def check_members(archive: tarfile.TarFile) -> None:
    """Refuse what a build context cannot hold: escaping names, devices, FIFOs, too many members."""
    members = archive.getmembers()
    if len(members) > MAX_MEMBERS:
        raise StepError(f"the uploaded archive has more than {MAX_MEMBERS} members")
    for member in members:
        name = member.name
        parts = name.split("/")
        if name.startswith("/") or ".." in parts or "\0" in name or not name:
            raise StepError(f"the uploaded archive holds an unsafe path {name!r}")
        if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
            raise StepError(f"the uploaded archive holds {name!r}, which is not a file, directory or link")
        if member.islnk() and (member.linkname.startswith("/") or ".." in member.linkname.split("/")):
            raise StepError(f"the uploaded archive holds a hard link escaping it: {name!r}")


def files_hash(archive: tarfile.TarFile, src: str, dest: str) -> str:
    """The SDK's ``calculate_files_hash`` recomputed from the archive it uploaded for ``src``."""
    digest = hashlib.sha256(f"COPY {src} {dest}".encode())
    for member in archive.getmembers():
        digest.update(member.name.encode())
        if member.issym():
            target = member.linkname.encode()
            digest.update(str(stat.S_IFLNK | 0o777).encode() + str(len(target)).encode() + target)
            continue
        if member.isdir():
            digest.update(str(stat.S_IFDIR | member.mode).encode())
            continue
        data = archive.extractfile(member)
        content = data.read() if data is not None else b""
        digest.update(str(stat.S_IFREG | member.mode).encode() + str(len(content)).encode() + content)
    return digest.hexdigest()


@dataclass(frozen=True)
class Owner:
    uid: int = 0
    gid: int = 0


def copy_roots(archive: tarfile.TarFile) -> list[tarfile.TarInfo]:
    """The members the COPY source named: those not inside another member directory.

    The SDK names members relative to the build context, so copying the context itself (``.``)
    holds ``.`` and then its entries as ``name``, not ``./name``.
    """
    members = archive.getmembers()
    dot = [m for m in members if m.name == "."]
    if dot:
        return dot
    dirs = {m.name for m in members if m.isdir()}

    def inside(name: str) -> bool:
        parent = posixpath.dirname(name)
        while parent:
            if parent in dirs:
                return True
            parent = posixpath.dirname(parent)
        return False

    return [m for m in members if not inside(m.name)]


def copy_archive(
    archive: tarfile.TarFile, dest: str, *, dest_is_dir: bool, owner: Owner, mode: int | None
) -> bytes:
    """The plain tar of a COPY, members named by their place under ``/`` (Docker's rules).

    A directory source copies its contents into ``dest``; a file goes to ``dest`` itself unless
    ``dest`` is a directory (it ends with ``/``, exists, or several sources are copied).
    """
    roots = copy_roots(archive)
    into_dir = dest_is_dir or dest.endswith("/") or len(roots) > 1
    target = posixpath.normpath(dest)
    mapping: dict[str, str] = {}
    for root in roots:
        if root.isdir():
            base = target
        else:
            base = posixpath.join(target, posixpath.basename(root.name)) if into_dir else target
        mapping[root.name] = base
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as plain:
        for member in archive.getmembers():
            placed = _place(member.name, mapping)
            if placed is None or (member.isdir() and member.name in mapping):
                continue
            info = _rewritten(member, placed, mapping, owner, mode)
            plain.addfile(info, archive.extractfile(member) if member.isreg() else None)
    return out.getvalue()


def _place(name: str, mapping: dict[str, str]) -> str | None:
    for root, base in mapping.items():
        if name == root:
            return base
        prefix = "" if root == "." else root + "/"
        if name.startswith(prefix):
            return posixpath.join(base, name[len(prefix) :])
    return None


def _rewritten(
    member: tarfile.TarInfo, placed: str, mapping: dict[str, str], owner: Owner, mode: int | None
) -> tarfile.TarInfo:
    info = tarfile.TarInfo(placed.lstrip("/"))
    info.type, info.size, info.mtime = member.type, member.size, member.mtime
    info.mode = mode if mode is not None and not member.issym() else member.mode
    info.uid, info.gid, info.uname, info.gname = owner.uid, owner.gid, "", ""
    if member.issym():
        info.linkname = member.linkname
    elif member.islnk():
        linked = _place(member.linkname, mapping)
        if linked is None:
            raise StepError(f"hard link {member.name!r} points outside the copied files")
        info.linkname, info.size = linked.lstrip("/"), 0
    return info


def parse_mode(raw: str) -> int | None:
    """COPY's mode argument: empty, or octal digits."""
    if not raw:
        return None
    if not re.fullmatch(r"[0-7]{1,4}", raw):
        raise StepError(f"invalid COPY mode {raw!r}: octal digits expected")
    return int(raw, 8)


def verified_archive(upload: Path, step: Step) -> tarfile.TarFile:
    """The upload of a COPY step, opened and checked against its ``filesHash``."""
    archive = read_archive(upload.read_bytes())
    check_members(archive)
    if files_hash(archive, step.args[0], step.args[1]) != step.files_hash:
        raise StepError(f"the files uploaded for COPY {step.args[0]} do not match their hash")
    return archive
