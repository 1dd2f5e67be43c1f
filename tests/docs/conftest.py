"""A reader's shell for the docs tests, and the node the blocks that are not about a fresh start
run against.

The reader's working directory stands for the repository checkout the README is read in: `.venv`
is the interpreter running the tests (the repository's own venv under `make test`), `templates`
the repository's, and the code is this tree's (PYTHONPATH). Nothing of the host's `aenv auth`
credentials, `AENV_*` or `E2B_*` settings leaks in.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from aenv.devnode import PASSED_THROUGH, DevNode

from .blocks import REPO

# Network slots apart from every other node the suite starts (e2e 8192, bench 12288, ...).
SLOT_FIRST = 10496  # to 10751 (four ranges); tests/fusion take 10240-10367
SLOT_COUNT = 64


@dataclass
class Reader:
    """A shell in a checkout: where blocks run, with what environment."""

    workdir: Path
    env: dict[str, str]

    def run(self, lang: str, text: str, timeout: float = 540, **env: str) -> subprocess.CompletedProcess[str]:
        """Run a block as pasted: a shell block in bash (stopping at the first failing command), a
        Python block with the checkout's `.venv/bin/python`."""
        command = ["bash", "-e", "-c", text] if lang == "sh" else [".venv/bin/python", "-c", text]
        env = {**self.env, **env}
        result = subprocess.run(
            command, cwd=self.workdir, env=env, capture_output=True, text=True, timeout=timeout
        )
        assert result.returncode == 0, f"exit {result.returncode}:\n{result.stdout}\n{result.stderr}"
        return result


@pytest.fixture
def reader(tmp_path: Path) -> Reader:
    workdir = tmp_path / "checkout"
    workdir.mkdir()
    (workdir / ".venv").symlink_to(Path(sys.prefix))
    (workdir / "templates").symlink_to(REPO / "templates")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
    env.update({name: os.environ[name] for name in PASSED_THROUGH if name in os.environ})
    env.update(PYTHONPATH=str(REPO / "src"), XDG_CONFIG_HOME=str(tmp_path / "config"))
    return Reader(workdir, env)


@pytest.fixture(scope="module")
def docs_node(tmp_path_factory: pytest.TempPathFactory, template_seed: Path) -> Iterator[DevNode]:
    """`make run`'s node, as the tests can run it: `aenv server` on a temporary home seeded with
    the session's `base` (`make run` serves forever on :8000 and /var/lib/aenv)."""
    home = tmp_path_factory.mktemp("aenv-docs") / "home"
    node = DevNode(home, slot_first=SLOT_FIRST, slot_count=SLOT_COUNT, seed=template_seed, warm_pool_size=1)
    try:
        node.start()
        # Where `make run`'s node keeps its key; the blocks read it from there.
        (home / "secrets").mkdir(exist_ok=True)
        key_file(node).write_text(node.key)
        yield node
    finally:
        forced = node.cleanup()
        if forced:
            print(f"\naenv docs node teardown cleaned up by force: {', '.join(forced)}", file=sys.stderr)


def key_file(node: DevNode) -> Path:
    return node.home / "secrets" / "api-key"


@pytest.fixture
def clean_node(docs_node: DevNode) -> Iterator[DevNode]:
    """The module's node; every sandbox the block left running or paused is killed afterwards."""
    yield docs_node
    with httpx.Client(base_url=docs_node.url, headers={"X-API-Key": docs_node.key}, timeout=120) as api:
        for sandbox in api.get("/v2/sandboxes", params={"state": "running,paused", "limit": 100}).json():
            with contextlib.suppress(httpx.HTTPError):
                api.delete(f"/sandboxes/{sandbox['sandboxID']}")
