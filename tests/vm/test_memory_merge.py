"""Memory merging (`memory_merge`, aenv.vmm.merge) on a real node with KSM running.

The node's QEMUs start mergeable and with a fixed layout. Two sandboxes that hold the same data
get those pages merged (the node's `/metrics` says how much that saves), and a sandbox whose
pages were merged pauses and resumes to exactly its state: a merged page is still a page the
guest wrote, so the pause's delta keeps it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aenv.devnode import DevNode
from aenv.vmm import merge
from tests.conftest import wait_for

pytestmark = pytest.mark.vm

SLOT_FIRST = 14592  # apart from every other node the suite starts (and the bench's)
SAME_MIB = 16
SEED = 7
# Writes SAME_MIB MiB that are the same in every sandbox (the guest's tmpfs is guest RAM).
WRITE_SAME = (
    "python3 -c 'import random, sys; "
    f"sys.stdout.buffer.write(random.Random({SEED}).randbytes({SAME_MIB} << 20))' > /dev/shm/same"
)
NO_RANDOMIZE = 0x0040000


@pytest.fixture
def ksm() -> Iterator[None]:
    """KSM running and scanning fast for the test; the host's own settings restored after."""
    if os.geteuid() != 0 or not merge.KSM.is_dir():
        pytest.skip("needs root and a kernel with KSM")
    fast = {"pages_to_scan": "10000", "sleep_millisecs": "10", "run": "1"}
    saved = {name: (merge.KSM / name).read_text().strip() for name in fast}
    try:
        for name, value in fast.items():
            (merge.KSM / name).write_text(value)
        yield
    finally:
        for name, value in saved.items():
            (merge.KSM / name).write_text(value)


def _ksm_stat(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/ksm_stat").read_text().splitlines()
    return dict(line.split(" ", 1) for line in lines)


def test_merged_pages_pause_and_resume_exactly(
    tmp_path: Path, template_seed: Path, ksm: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from e2b import Sandbox

    node = DevNode(
        tmp_path / "home", slot_first=SLOT_FIRST, slot_count=64, seed=template_seed, warm_pool_size=0,
        memory_merge=True,
    )  # fmt: skip
    with node:
        for name in [n for n in os.environ if n.startswith("E2B_")]:
            monkeypatch.delenv(name)
        monkeypatch.setenv("E2B_API_URL", node.url)
        monkeypatch.setenv("E2B_SANDBOX_URL", node.url)
        monkeypatch.setenv("E2B_API_KEY", node.key)
        sandboxes = [Sandbox.create(timeout=300) for _ in range(2)]
        states = [node.home / "sandboxes" / s.sandbox_id / "state.json" for s in sandboxes]
        pids = [json.loads(state.read_text())["pid"] for state in states]
        for pid in pids:
            assert int(Path(f"/proc/{pid}/personality").read_text(), 16) & NO_RANDOMIZE
            assert _ksm_stat(pid)["ksm_merge_any:"] == "yes"
        for sandbox in sandboxes:
            sandbox.commands.run(WRITE_SAME)
        first = sandboxes[0]
        first.commands.run(f"echo {first.sandbox_id} > /dev/shm/own")
        # Half of the shared data merged in the first sandbox's QEMU.
        wait_for(lambda: int(_ksm_stat(pids[0])["ksm_merging_pages"]) >= (SAME_MIB << 8) // 2, timeout=120)
        metrics = httpx.get(f"{node.url}/metrics", timeout=30).text.splitlines()
        saved = next(line for line in metrics if line.startswith("aenv_memory_merge_saved_bytes "))
        assert float(saved.split()[1]) >= (SAME_MIB << 20) // 4
        assert first.pause()
        resumed = Sandbox.connect(first.sandbox_id)
        expected = hashlib.sha256(random.Random(SEED).randbytes(SAME_MIB << 20)).hexdigest()
        assert resumed.commands.run("sha256sum /dev/shm/same").stdout.split()[0] == expected
        assert resumed.commands.run("cat /dev/shm/own").stdout.strip() == first.sandbox_id
        for sandbox in sandboxes:
            sandbox.kill()
