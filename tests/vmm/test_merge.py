"""Memory merging's process flags (aenv.vmm.merge), in a child process so the suite's own memory
stays as it was: made mergeable, a process and what it starts are merged by KSM, and only what
it starts inside `fixed_layout` runs without layout randomisation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aenv.vmm import merge

CHILD = textwrap.dedent(
    """
    import json, subprocess
    from aenv.vmm import merge
    def child():
        files = ["/proc/self/personality", "/proc/self/ksm_stat"]
        return subprocess.run(["cat", *files], capture_output=True, text=True).stdout
    before = child()
    merge.enable()
    with merge.fixed_layout():
        inside = child()
    after = child()
    print(json.dumps([before, inside, after]))
    """
)


def test_enabled_merging_marks_children_mergeable_and_fixes_only_the_layout_of_those_it_wraps():
    if os.geteuid() != 0 or not merge.KSM.is_dir():
        pytest.skip("needs root (CAP_SYS_RESOURCE) and a kernel with KSM")
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    before, inside, after = (text.split("\n") for text in json.loads(done.stdout.splitlines()[-1]))
    assert "ksm_merge_any: no" in before and int(before[0], 16) & 0x0040000 == 0
    assert "ksm_merge_any: yes" in inside and int(inside[0], 16) & 0x0040000
    assert "ksm_merge_any: yes" in after and int(after[0], 16) & 0x0040000 == 0


def test_without_merging_the_layout_stays_random():
    with merge.fixed_layout():
        personality = Path("/proc/self/personality").read_text()
    assert int(personality, 16) & 0x0040000 == 0
