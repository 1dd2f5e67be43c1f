"""HTTP `/health`, `/init`, `/envs`, `/metrics`."""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import re
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from aiohttp import web

from . import ENVD_VERSION, volumes
from .connect import ConnectError, loads
from .httperr import UNAUTHORIZED, json_error
from .inputs import c_string, path_string, string_map, text
from .metrics import MetricsHistory, Sample, render, take
from .state import State, same_secret

log = logging.getLogger(__name__)

CLOCK_TOLERANCE_NS = 50_000_000
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)
_FRACTION = re.compile(r"(\.\d{6})\d+")


def parse_rfc3339_ns(value: str) -> int:
    """RFC 3339 timestamp -> Unix nanoseconds (fractions beyond microseconds are truncated)."""
    text = _FRACTION.sub(r"\1", value.strip().replace("z", "Z"))
    dt = datetime.fromisoformat(text)
    if dt.tzinfo is None:
        raise ValueError("timestamp needs a UTC offset")
    return int(dt.timestamp()) * 1_000_000_000 + dt.microsecond * 1000


def sync_clock(target_ns: int) -> bool:
    """Step CLOCK_REALTIME to `target_ns` if it is off by more than the tolerance; True if it was set."""
    drift = target_ns - time.time_ns()
    if abs(drift) <= CLOCK_TOLERANCE_NS:
        return False
    try:
        time.clock_settime_ns(time.CLOCK_REALTIME, target_ns)
    except (OSError, OverflowError) as e:
        log.warning("cannot set the clock (drift %.3f s): %s", drift / 1e9, e)
        return False
    # Not at INFO: every restored guest steps its clock (by the time its snapshot sat), and the
    # line would go through the emulated serial console, byte by byte, on the path of the node's
    # `/init` (under TCG, translated afresh in every fork child and released resume).
    log.debug("clock stepped by %.3f s", drift / 1e9)
    return True


def add_entropy(data: bytes) -> bool:
    """Mix bytes into the kernel pool and force a CRNG reseed, so restored snapshots diverge. Best effort."""
    import fcntl

    try:
        with open("/dev/urandom", "wb", buffering=0) as f:
            f.write(data)
            try:
                fcntl.ioctl(f.fileno(), RNDRESEEDCRNG)
            except OSError as e:
                log.debug("RNDRESEEDCRNG failed: %s", e)
    except OSError as e:
        log.warning("cannot add entropy: %s", e)
        return False
    return True


@dataclass(frozen=True)
class InitRequest:
    """What a valid `/init` body asks for."""

    env_vars: dict[str, str]
    token: str | None  # None: leave as is; "": none from now on (an unsecured sandbox's guest)
    user: str
    workdir: str
    timestamp: int | None  # Unix nanoseconds
    entropy: bytes | None
    mounts: (
        list[volumes.VolumeMount] | None
    )  # volumes to mount from the node (aenv.volumes); None: leave as is

    def apply(self, state: State) -> None:
        if self.timestamp is not None:
            sync_clock(self.timestamp)
        if self.entropy:
            add_entropy(self.entropy)
        # A resume's /init repeats what the sandbox already has: nothing to write then (under
        # TCG, a guest's first write in a new QEMU process costs ~40 ms of emulated CPU and
        # ~3 MiB of translated code). A change is written once the answer is out (the callback
        # runs before envd reads its next request): the node's create waits for that answer.
        token = self.token or None
        changed = (
            any(state.env_vars.get(name) != value for name, value in self.env_vars.items())
            or (self.token is not None and token != state.access_token)
            or (self.user and self.user != state.default_user)
            or (self.workdir and self.workdir != state.default_workdir)
        )
        state.env_vars.update(self.env_vars)
        if self.token is not None:
            state.access_token = token
        if self.user:
            state.default_user = self.user
        if self.workdir:
            state.default_workdir = self.workdir
        if changed:
            asyncio.get_running_loop().call_soon(state.save)


def parse_init(raw: bytes) -> InitRequest | str:
    """An `/init` body, checked; or why it is refused (a 400's message)."""
    try:
        body: Any = loads(raw)
    except ValueError:
        return "invalid JSON body"
    if not isinstance(body, dict):
        return "body must be a JSON object"
    try:
        env_vars = string_map(body.get("envVars"), "envVars")
        user, workdir = (text(body, name) for name in ("defaultUser", "defaultWorkdir"))
        token = text(body, "accessToken") if "accessToken" in body else None
        c_string(user, "defaultUser")
        if workdir:
            path_string(workdir, "defaultWorkdir")
        timestamp = parse_rfc3339_ns(text(body, "timestamp")) if body.get("timestamp") else None
        entropy = base64.b64decode(text(body, "entropy"), validate=True) if body.get("entropy") else None
        mounts = volumes.parse(body["volumeMounts"]) if "volumeMounts" in body else None
    except ConnectError as e:
        return e.message
    except (ValueError, binascii.Error) as e:
        return f"invalid init field: {e}"
    return InitRequest(env_vars, token, user, workdir, timestamp, entropy, mounts)


class SystemAPI:
    def __init__(self, state: State, history: MetricsHistory) -> None:
        self.state = state
        self.history = history
        self._last: Sample | None = None  # /metrics reports CPU use since the previous call

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/health", self.health),
            web.post("/init", self.init),
            web.get("/envs", self.envs),
            web.get("/metrics", self.metrics),
            web.get("/metrics/history", self.metrics_history),
        ]

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=204, headers={"Cache-Control": "no-store", "X-Envd-Version": ENVD_VERSION})

    async def init(self, request: web.Request) -> web.Response:
        """Configure the sandbox. Once a token is set, re-initialising requires presenting it,
        except for the node itself (the host peer). What it sets survives an envd restart."""
        current = self.state.access_token
        from_node = self.state.host_peer is not None and request.remote == self.state.host_peer
        if current and not from_node and not same_secret(request.headers.get("X-Access-Token", ""), current):
            return json_error(401, UNAUTHORIZED)
        parsed = parse_init(await request.read())
        if isinstance(parsed, str):
            return json_error(400, parsed)
        if parsed.mounts is not None:
            if self.state.host_peer is None:
                return json_error(400, "volumeMounts need the node's address (envd runs without --host-peer)")
            try:
                await asyncio.to_thread(volumes.apply, self.state.host_peer, parsed.mounts)
            except OSError as e:
                return json_error(500, str(e))
        parsed.apply(self.state)
        if (
            parsed.mounts is not None
        ):  # the node checks that this guest mounted them (an older envd ignores them)
            return web.json_response({"volumeMounts": [m.path for m in parsed.mounts]})
        return web.Response(status=204)

    async def envs(self, request: web.Request) -> web.Response:
        return web.json_response(self.state.env_vars)

    async def metrics(self, request: web.Request) -> web.Response:
        now = take()
        answer = render(now, self._last)
        self._last = now
        return web.json_response(answer)

    async def metrics_history(self, request: web.Request) -> web.Response:
        """The samples kept since `start` until `end` (Unix seconds, both optional), oldest first."""
        try:
            start, end = (
                int(request.query[name]) if request.query.get(name) else None for name in ("start", "end")
            )
        except ValueError:
            return json_error(400, "start and end must be integer Unix seconds")
        return web.json_response(self.history.answer(start, end))
