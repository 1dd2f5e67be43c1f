"""Running a build's steps inside the build VM, through its envd, as E2B defines them.

- ``RUN`` runs the command with bash (``sh`` where the image has no bash) as the step's user, or
  the current one, with the current environment and workdir; a non-zero exit fails the step.
- ``ENV`` expands each value with the shell (as inside double quotes) and keeps it for later
  steps and for the template's sandboxes.
- ``USER`` creates the user if the image lacks it and makes it the default from then on.
- ``WORKDIR`` creates the directory (owned by the current user) and makes it the default.
- ``COPY`` checks the upload against its hash on the host, maps it with Docker's rules
  (``aenv.template.steps.copy_archive``) and extracts the result at ``/`` as root.

Everything runs in the guest; the host only reads the uploaded archive as data, so a hostile
upload can touch nothing of the host.
"""

from __future__ import annotations

import asyncio
import secrets
import shlex
from collections.abc import Callable

from aenv.template.steps import (
    DEFAULT_USER,
    BuildState,
    Owner,
    Step,
    StepError,
    copy_archive,
    expand_command,
    parse_mode,
    verified_archive,
)
from aenv.template.uploads import UploadStore
from aenv.vmm.envd_link import EnvdLink

STEP_TIMEOUT = 3600.0  # seconds a RUN may take
# The command is the script's $1: bash when the image has it (E2B's shell), else POSIX sh.
SHELL = ["/bin/sh", "-c", 'if [ -x /bin/bash ]; then exec /bin/bash -c "$1"; fi; exec /bin/sh -c "$1"', "sh"]
# Start and ready commands run in a login shell, as E2B runs them (`bash -l -c`).
LOGIN_SHELL = [
    "/bin/sh", "-c", 'if [ -x /bin/bash ]; then exec /bin/bash -l -c "$1"; fi; exec /bin/sh -l -c "$1"', "sh",
]  # fmt: skip
Log = Callable[[str], None]


class LineLog:
    """Turns a command's output chunks into log lines (called from envd's reader thread)."""

    def __init__(self, log: Log):
        self.log = log
        self.partial = b""

    def feed(self, chunk: bytes) -> None:
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        for line in lines:
            self.log(line.decode(errors="replace").rstrip("\r"))

    def flush(self) -> None:
        if self.partial:
            self.log(self.partial.decode(errors="replace"))
            self.partial = b""


class StepRunner:
    """Runs steps in one build VM; each returns the state the next step starts from."""

    def __init__(self, envd: EnvdLink, uploads: UploadStore, log: Log):
        self.envd = envd
        self.uploads = uploads
        self.log = log

    async def shell(
        self, command: str, *, user: str, state: BuildState, quiet: bool = False, cwd: str | None = None
    ) -> tuple[int, str]:
        """Run a shell command in the workdir (or ``cwd``); its exit code and (when quiet) its output."""
        captured: list[bytes] = []
        lines = LineLog(self.log)
        code = await self.envd.execute(
            [*SHELL, command], user=user, envs=state.env, cwd=cwd or state.workdir,
            timeout=STEP_TIMEOUT, on_output=captured.append if quiet else lines.feed,
        )  # fmt: skip
        lines.flush()
        return int(code or 0), b"".join(captured).decode(errors="replace")

    async def root(self, command: str, state: BuildState, what: str) -> str:
        code, output = await self.shell(command, user="root", state=state, quiet=True, cwd="/")
        if code != 0:
            raise StepError(f"{what} failed (exit code {code}): {output.strip()[-500:]}")
        return output

    async def provision(self, state: BuildState) -> BuildState:
        """The base step: E2B's default user and home exist in every template."""
        await self.ensure_user(DEFAULT_USER, state)
        await self.root(f"mkdir -p {shlex.quote(state.workdir)}", state, "creating the home directory")
        return state

    async def ensure_user(self, name: str, state: BuildState) -> None:
        user = shlex.quote(name)
        await self.root(
            f"id -u {user} >/dev/null 2>&1 || useradd -m {user} 2>/dev/null || adduser -D {user}",
            state, f"creating user {name}",
        )  # fmt: skip

    async def run(self, step: Step, state: BuildState) -> BuildState:
        handlers = {"RUN": self._run, "ENV": self._env, "USER": self._user, "WORKDIR": self._workdir}
        return await handlers.get(step.type, self._copy)(step, state)

    async def _run(self, step: Step, state: BuildState) -> BuildState:
        user = step.args[1] if len(step.args) > 1 and step.args[1] else state.user
        code, _ = await self.shell(step.args[0], user=user, state=state)
        if code != 0:
            raise StepError(f"command exited with code {code}: {step.args[0]}")
        return state

    async def _env(self, step: Step, state: BuildState) -> BuildState:
        values = {}
        for key, raw in zip(step.args[::2], step.args[1::2], strict=True):
            code, value = await self.shell(expand_command(raw), user=state.user, state=state, quiet=True)
            if code != 0:
                raise StepError(f"expanding {key} failed (exit code {code}): {value.strip()[-500:]}")
            values[key] = value
        return state.with_env(values)

    async def _user(self, step: Step, state: BuildState) -> BuildState:
        await self.ensure_user(step.args[0], state)
        return BuildState(env=state.env, user=step.args[0], workdir=state.workdir)

    async def _workdir(self, step: Step, state: BuildState) -> BuildState:
        path = shlex.quote(state.path(step.args[0]))
        user = shlex.quote(state.user)
        await self.root(f"[ -d {path} ] || {{ mkdir -p {path} && chown {user} {path}; }}", state, "WORKDIR")
        return BuildState(env=state.env, user=state.user, workdir=state.path(step.args[0]))

    async def _copy(self, step: Step, state: BuildState) -> BuildState:
        src, dest = step.args[0], step.args[1]
        owner = await self._owner(step.args[2] if len(step.args) > 2 else "", state)
        mode = parse_mode(step.args[3] if len(step.args) > 3 else "")
        assert step.files_hash is not None  # the model requires it for COPY
        try:
            archive = await asyncio.to_thread(verified_archive, self.uploads.archive(step.files_hash), step)
        except StepError:
            self.uploads.discard(step.files_hash)
            raise
        self.uploads.mark_present(step.files_hash)
        target = state.path(dest) + ("/" if dest.endswith("/") else "")
        code, _ = await self.shell(
            f"[ -d {shlex.quote(target)} ]", user="root", state=state, quiet=True, cwd="/"
        )
        plain = await asyncio.to_thread(
            copy_archive, archive, target, dest_is_dir=code == 0, owner=owner, mode=mode
        )
        staged = f"/.aenv-copy-{secrets.token_hex(6)}.tar"
        await self.envd.write_file(staged, plain)
        await self.root(
            f"tar -xpf {staged} -C /; status=$?; rm -f {staged}; exit $status", state, f"COPY {src}"
        )
        return state

    async def _owner(self, spec: str, state: BuildState) -> Owner:
        """``user[:group]`` (names or numbers) as ids in the guest; root when empty."""
        if not spec:
            return Owner()
        user, _, group = spec.partition(":")
        quoted_user, quoted_group = shlex.quote(user), shlex.quote(group)
        uid = user if user.isdigit() else await self.root(f"id -u {quoted_user}", state, f"looking up {user}")
        if not group:
            gid = (
                "0"
                if user.isdigit()
                else await self.root(f"id -g {quoted_user}", state, f"looking up {user}")
            )
        elif group.isdigit():
            gid = group
        else:
            gid = await self.root(
                f"awk -F: -v g={quoted_group} '$1==g {{print $3}}' /etc/group | grep .",
                state, f"looking up group {group}",
            )  # fmt: skip
        try:
            return Owner(int(uid.strip()), int(gid.strip()))
        except ValueError:
            raise StepError(f"COPY owner {spec!r} is not a user (and group) of the image") from None
