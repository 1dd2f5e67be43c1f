"""The node under test: one the harness starts on a throwaway home, or a running one named by AENV_URL.

A node the harness starts is an `aenv.devnode.DevNode`: a real `aenv server` subprocess in a
session of its own (so Ctrl-C reaches only the harness, which then stops it in order). It gets
network slots of its own (12288…, apart from the test suites' 4096 and 8192), `shutdown_action=kill`
so SIGTERM ends its sandboxes, a long default timeout so no sandbox expires mid-run, and a short
parking time (`PARK_SECONDS`) so that the resume of a sandbox whose parked process the node has
released can be measured without waiting the default five minutes. Its home
may be seeded with the `base` template of another home (`--seed`), else its first start builds
one. Stopping it removes what it may have left behind (QEMU processes under its home, the
namespaces of its slot range and of its template builds) and the temporary directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aenv.config import Settings
from aenv.devnode import DevNode
from aenv.paths import repository_dir
from aenv.repository.errors import RepositoryError
from aenv.repository.posix import SnapshotRepository
from aenv.snapshot.warm import WarmRecord

REPO = Path(__file__).resolve().parents[1]
SLOT_FIRST = 12288
SLOT_COUNT = 1024
DEFAULT_TIMEOUT = 6 * 3600  # seconds: longer than any run, so the TTL never ends a sandbox early
# Seconds a paused sandbox keeps its QEMU process: longer than any figure takes between a pause
# and its resume (50 pauses of the concurrent resume included), short enough to wait for.
PARK_SECONDS = 10.0
# `--memory-pressed`: the node's reclaim_pressure_mib, above any host's available memory, so its
# reclaimer acts as under pressure throughout (guests drop their clean page cache).
PRESSED_MIB = 1 << 30


class BenchError(RuntimeError):
    """The node or a guest did not do what a measurement needs; `status`: the node's HTTP status
    when it answered otherwise than the API documents for success."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Node:
    """How to reach the node; `home` and `pid` only when it runs on this host under the harness."""

    url: str
    api_key: str
    home: Path | None = None
    pid: int | None = None
    warm_pool: int | None = None  # warm VMs per template the node keeps, when known
    park_seconds: float | None = None  # how long a paused sandbox keeps its process, when known
    memory_merge: bool = False  # the node merges equal pages across its QEMUs (`--memory-merge`)
    memory_pressed: bool = False  # the node reclaims as under host pressure throughout (`--memory-pressed`)

    @property
    def local(self) -> bool:
        return self.home is not None

    def sandbox_pids(self) -> dict[str, int]:
        """QEMU pid of each running sandbox, from the node's saved sandbox states."""
        pids = {}
        if self.home is None:
            return pids
        for state_file in (self.home / "sandboxes").glob("*/state.json"):
            with contextlib.suppress(OSError, ValueError):
                state = json.loads(state_file.read_text())
                if state.get("pid"):
                    pids[state["sandbox_id"]] = int(state["pid"])
        return pids

    def state(self, sandbox_id: str) -> dict[str, Any]:
        """The engine's saved state of a sandbox (namespace, QEMU pid, last pause's files)."""
        if self.home is None:
            raise BenchError("a sandbox's saved state is only readable for a node on this host")
        return json.loads((self.home / "sandboxes" / sandbox_id / "state.json").read_text())

    def pause_delta_bytes(self, sandbox_id: str) -> int | None:
        """Size of the memory delta the last pause of a sandbox wrote."""
        if self.home is None:
            return None
        with contextlib.suppress(OSError, ValueError, TypeError):
            return Path(self.state(sandbox_id)["delta"]).stat().st_size
        return None

    def process_kept(self, sandbox_id: str) -> bool | None:
        """Whether a paused sandbox still has its (stopped) QEMU process: a node may keep it for a
        quick resume. None when this cannot be seen from here."""
        if self.home is None:
            return None
        pid = self.state(sandbox_id).get("pid")
        return pid is not None and Path(f"/proc/{pid}").exists()

    def snapshot_delta_bytes(self, snapshot_id: str) -> int | None:
        """Size of a committed snapshot's memory delta, from its manifest."""
        if self.home is None:
            return None
        with contextlib.suppress(RepositoryError):
            manifest = SnapshotRepository(repository_dir(self.home)).get(snapshot_id)
            return sum(manifest.sizes.get(d, 0) for d in manifest.memory_deltas)
        return None

    def warm_ready(self, snapshot_id: str) -> int:
        """Warm VMs of a snapshot that are ready: in the pool, their restore, rehearsal and clock
        setting done (their record says so; it exists from the QEMU process's start on)."""
        return 0 if self.home is None else WarmRecord.ready_count(self.home / "runtime" / "warm", snapshot_id)


def remote_node() -> Node | None:
    """The node named by AENV_URL (with AENV_API_KEY), if any."""
    url = os.environ.get("AENV_URL")
    if not url:
        return None
    return Node(url=url.rstrip("/"), api_key=os.environ.get("AENV_API_KEY", ""))


class LocalNode:
    """The harness's own node in a temporary directory, removed afterwards; a context manager."""

    def __init__(
        self, seed: Path | None = None, memory_merge: bool = False, memory_pressed: bool = False
    ) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="aenv-bench-"))
        self.memory_merge, self.memory_pressed = memory_merge, memory_pressed
        pressure = {"reclaim_pressure_mib": PRESSED_MIB} if memory_pressed else {}
        self.dev = DevNode(
            self.workdir / "home", slot_first=SLOT_FIRST, slot_count=SLOT_COUNT, seed=seed,
            log_path=self.workdir / "node.log", shutdown_action="kill", default_timeout=DEFAULT_TIMEOUT,
            park_seconds=PARK_SECONDS, memory_merge=memory_merge, **pressure,
        )  # fmt: skip

    def __enter__(self) -> Node:
        try:
            self.dev.start()
        except BaseException:
            self.stop()
            raise
        dev = self.dev
        pool = Settings.warm_pool_size  # the node's default: the harness sets none
        return Node(
            url=dev.url,
            api_key=dev.key,
            home=dev.home,
            pid=dev.pid,
            warm_pool=pool,
            park_seconds=PARK_SECONDS,
            memory_merge=self.memory_merge,
            memory_pressed=self.memory_pressed,
        )

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> list[str]:
        """Stop the node and remove all it leaves; returns what had to be removed by force."""
        forced = self.dev.cleanup()
        if forced:
            print(f"bench: cleaned up after the node by force: {', '.join(forced)}", file=sys.stderr)
            print(f"bench: the node's log ends with:\n{self.dev.log_tail(20)}", file=sys.stderr)
        shutil.rmtree(self.workdir, ignore_errors=True)
        return forced
