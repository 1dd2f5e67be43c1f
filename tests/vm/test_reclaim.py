"""Freed guest memory leaves the QEMU process (aenv.vmm.reclaim, aenv.orchestrator.reclaim).

Real VMs restored from the session's base template: a guest allocates and touches 200 MiB, then
frees it, and writes then deletes 100 MiB of files; the node's policy gives the freed pages back
to the host. The memory image other clones map is never written, and what the guest holds (a
file on its tmpfs, in guest RAM) comes back exactly after a pause and resume, and in a fork;
also after the guest dropped its page cache under host pressure and the node remapped what it
zeroed.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from pathlib import Path
from types import SimpleNamespace

from aenv.orchestrator.reclaim import MemoryReclaimer, private_mib
from aenv.orchestrator.states import State
from aenv.snapshot import memory
from aenv.snapshot.memory import PAGE_SIZE, find_mapping
from aenv.vmm import reclaim

ALLOCATE = "python3 -c 'b = bytearray(200 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\n'"
FILES = "dd if=/dev/urandom of=/root/big bs=1M count=100 status=none && sync && rm /root/big && sync"
KEEP = "head -c 8M /dev/urandom > /dev/shm/keep && sha256sum /dev/shm/keep"
TOOLS = "sha256sum /usr/bin/python3 /bin/bash /bin/dd"


def digest(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def diverge(sandbox) -> float:
    """Run the divergence workload in the guest; returns the QEMU's private MiB after it."""
    sdk = sandbox.sdk()
    sdk.commands.run(ALLOCATE, timeout=120)
    sdk.commands.run(FILES, user="root", timeout=120)
    return private_mib(sandbox.vm.vm.pid)


def guest_private(sandbox) -> float:
    """MiB of the guest's RAM the sandbox holds privately (pages written and not given back)."""
    vm = sandbox.vm.vm
    return reclaim.private_mib(vm.pid, *find_mapping(vm.pid, vm.config.memory_path))


def kept(sandbox) -> str:
    return sandbox.sdk().commands.run("sha256sum /dev/shm/keep", user="root").stdout


def test_freed_guest_memory_goes_back_to_the_host_and_state_stays_exact(sandboxes, base_template, node_loop):
    parent = sandboxes.start(base_template.id)
    image = parent.vm.vm.config.memory_path
    before = digest(image)
    fresh = private_mib(parent.vm.vm.pid)
    marker = parent.sdk().commands.run(KEEP, user="root").stdout

    # The node's policy, over this one sandbox as the orchestrator holds it.
    held = SimpleNamespace(id=parent.sandbox_id, vm=parent.vm, lock=asyncio.Lock(),
                           record=SimpleNamespace(state=State.RUNNING))  # fmt: skip
    # idle_share: the test sweeps right after the workload; the node waits until the guest rests.
    policy = MemoryReclaimer(lambda: [held], interval=0, growth_mib=16, pressure_mib=0, idle_share=math.inf)
    assert node_loop.run(policy.sweep()) == 0  # the first pass records where the sandbox stands
    diverged = diverge(parent)
    assert diverged - fresh > 250, (fresh, diverged)
    returned = node_loop.run(policy.sweep())
    after = private_mib(parent.vm.vm.pid)
    assert returned >= 0.8 * 200 * 2**20, returned
    assert diverged - after >= 0.8 * 200, (fresh, diverged, after)  # the rest: QEMU's own (TCG's cache)
    assert guest_private(parent) < 32
    metrics = {m.name: m for m in policy.collect()}
    assert metrics["aenv_memory_returned_bytes"].samples[0].labels == {"sandbox_id": parent.sandbox_id}
    assert metrics["aenv_node_memory_returned_bytes"].samples[0].value == returned

    assert kept(parent) == marker
    child = sandboxes.fork(parent, 1)[0]
    assert kept(child) == marker
    diverge(child)
    assert node_loop.run(reclaim.reclaim(child.vm.vm)).returned_mib >= 0.8 * 200
    assert kept(child) == marker

    # Under host pressure a guest that grew drops its clean page cache: the pages that held the
    # image's data are zeroed, and go back remapped; the guest reads its files and memory as before.
    pressed = MemoryReclaimer(
        lambda: [held], interval=0, growth_mib=16, pressure_mib=1 << 30, idle_share=math.inf
    )
    assert node_loop.run(pressed.sweep()) == 0  # the first pass records where the sandbox stands
    diverge(parent)
    files = parent.sdk().commands.run(TOOLS, user="root").stdout
    assert node_loop.run(pressed.sweep()) >= 0.8 * 200 * 2**20
    vm = parent.vm.vm
    remapped = memory.remapped_pages(vm.pid, *find_mapping(vm.pid, image)).size * PAGE_SIZE / 2**20
    assert remapped >= 2 and guest_private(parent) < 32, (remapped, guest_private(parent))
    assert parent.sdk().commands.run(TOOLS, user="root").stdout == files
    assert kept(parent) == marker

    sandboxes.pause(parent)  # its capture holds the remapped runs as zero pages
    resumed = sandboxes.resume(parent.sandbox_id)
    assert kept(resumed) == marker
    diverge(resumed)
    assert node_loop.run(reclaim.reclaim(resumed.vm.vm)).returned_mib >= 0.8 * 200
    assert kept(resumed) == marker
    assert digest(image) == before
