"""Running a build's steps inside the build VM, through its envd, as E2B defines them.

- ``RUN`` runs the command with bash (``sh`` where the image has no bash) as the step's user, or
  the current one, with the current environment and workdir; a non-zero exit fails the step, and
  an image without ``/bin/sh`` fails it saying so.
- ``ENV`` expands each value with the shell (as inside double quotes) and keeps it for later
  steps and for the template's sandboxes; a value with nothing to expand needs no shell.
- ``USER`` creates the user if the image lacks it and makes it the default from then on.
- ``WORKDIR`` creates the directory (owned by the current user) and makes it the default.
- ``COPY`` checks the upload against its hash on the host, then streams it from disk to envd,
  which maps it with Docker's rules and unpacks it as root (``aenv.agent.envd.copying``).

Users, directories and COPY are envd's own work (``aenv.agent.envd.build_api``), so they need
nothing of the image: no ``useradd``, no ``tar``, no shell. The host only reads the uploaded
archive as data, so a hostile upload can touch nothing of the host.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from aenv.snapshot.templates import LineLog, Log
from aenv.template.steps import (
    DEFAULT_USER,
    BuildState,
    Step,
    StepError,
    expand_command,
    parse_mode,
    verified_roots,
)
from aenv.template.uploads import UploadStore
from aenv.vmm.envd_link import EnvdLink

STEP_TIMEOUT = 3600.0  # seconds a RUN may take
# The command is the script's $1: bash when the image has it (E2B's shell), else POSIX sh.
SHELL = ["/bin/sh", "-c", 'if [ -x /bin/bash ]; then exec /bin/bash -c "$1"; fi; exec /bin/sh -c "$1"', "sh"]
# What a shell expands inside double quotes (E2B's ENV semantics); a value without any is kept as is.
EXPANDED = re.compile(r"[$`\\]")


class StepRunner:
    """Runs steps in one build VM; each returns the state the next step starts from."""

    def __init__(self, envd: EnvdLink, uploads: UploadStore, log: Log):
        self.envd = envd
        self.uploads = uploads
        self.log = log
        self._shell: bool | None = None  # whether the image has /bin/sh (asked once)

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

    async def guest(self, path: str, payload: dict[str, Any], what: str) -> dict[str, Any]:
        """Call one of envd's build routes (``aenv.agent.envd.build_api``); a refusal fails the step."""
        status, answer = await self.envd.post_json(path, payload, timeout=STEP_TIMEOUT)
        return _answer(status, answer, what)

    async def provision(self, state: BuildState) -> BuildState:
        """The base step: E2B's default user, its home and (where the image has sudo) its
        passwordless sudo, as in the ``base`` template, exist in every template."""
        await self.guest(
            "/aenv/build/user", {"name": DEFAULT_USER, "sudo": True}, f"creating user {DEFAULT_USER}"
        )
        await self._make_workdir(state.workdir, DEFAULT_USER)
        return state

    async def ensure_user(self, name: str) -> None:
        await self.guest("/aenv/build/user", {"name": name}, f"creating user {name}")

    async def _make_workdir(self, path: str, user: str) -> None:
        await self.guest("/aenv/build/workdir", {"path": path, "user": user}, "WORKDIR")

    async def _need_shell(self, what: str) -> None:
        """A clear failure where a step needs the image's shell and the image has none."""
        if self._shell is None:
            self._shell = bool((await self.guest("/aenv/build/image", {}, "inspecting the image"))["shell"])
        if not self._shell:
            raise StepError(f"{what} needs /bin/sh, which the image does not have")

    async def run(self, step: Step, state: BuildState) -> BuildState:
        handlers = {"RUN": self._run, "ENV": self._env, "USER": self._user, "WORKDIR": self._workdir}
        return await handlers.get(step.type, self._copy)(step, state)

    async def _run(self, step: Step, state: BuildState) -> BuildState:
        await self._need_shell("RUN")
        user = step.args[1] if len(step.args) > 1 and step.args[1] else state.user
        code, _ = await self.shell(step.args[0], user=user, state=state)
        if code != 0:
            raise StepError(f"command exited with code {code}: {step.args[0]}")
        return state

    async def _env(self, step: Step, state: BuildState) -> BuildState:
        values = {}
        for key, raw in zip(step.args[::2], step.args[1::2], strict=True):
            if not EXPANDED.search(raw):  # nothing for the shell to expand
                values[key] = raw
                continue
            await self._need_shell(f"ENV {key} (its value has $, ` or \\ to expand)")
            code, value = await self.shell(expand_command(raw), user=state.user, state=state, quiet=True)
            if code != 0:
                raise StepError(f"expanding {key} failed (exit code {code}): {value.strip()[-500:]}")
            values[key] = value
        return state.with_env(values)

    async def _user(self, step: Step, state: BuildState) -> BuildState:
        await self.ensure_user(step.args[0])
        return BuildState(env=state.env, user=step.args[0], workdir=state.workdir)

    async def _workdir(self, step: Step, state: BuildState) -> BuildState:
        await self._make_workdir(state.path(step.args[0]), state.user)
        return BuildState(env=state.env, user=state.user, workdir=state.path(step.args[0]))

    async def _copy(self, step: Step, state: BuildState) -> BuildState:
        """Check the upload here, then stream it from disk to envd, which unpacks it as it arrives."""
        src, dest = step.args[0], step.args[1]
        plan = {
            "dest": state.path(dest) + ("/" if dest.endswith("/") else ""),
            "chown": step.args[2] if len(step.args) > 2 else "",
            "mode": parse_mode(step.args[3] if len(step.args) > 3 else ""),
        }
        assert step.files_hash is not None  # the model requires it for COPY
        try:
            plan["roots"] = await asyncio.to_thread(
                verified_roots, self.uploads.archive(step.files_hash), step
            )
        except StepError:
            self.uploads.discard(step.files_hash)
            raise
        self.uploads.mark_present(step.files_hash)
        head = json.dumps(plan).encode() + b"\n"
        status, answer = await self.envd.post_file(
            "/aenv/build/copy", head, self.uploads.archive(step.files_hash), timeout=STEP_TIMEOUT
        )
        _answer(status, answer, f"COPY {src}")
        return state


def _answer(status: int, answer: bytes, what: str) -> dict[str, Any]:
    try:
        body = json.loads(answer) if answer else {}
    except ValueError:
        body = {"message": answer[:500].decode(errors="replace")}
    if status >= 300:
        raise StepError(f"{what} failed: {body.get('message', status)}")
    return body
