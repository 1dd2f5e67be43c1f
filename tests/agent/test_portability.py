"""What lets envd and init run in any image, checked on the host without a VM: the shipped runtime
works in a tree with nothing but busybox, envd falls back to the image's /bin/sh for the SDK's
/bin/bash, and root exists even where the image has no /etc/passwd."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from aenv.agent import init
from aenv.agent.envd import process, users
from aenv.agent.envd.connect import ConnectError
from aenv.guest.runtime import ensure_runtime

BUSYBOX = Path("/bin/busybox")  # Debian's busybox-static, as the initramfs uses it
CHROOT = shutil.which("chroot") or "/usr/sbin/chroot"
PROBE = """
import ctypes, hashlib, ssl, subprocess, sys, threading
thread = threading.Thread(target=print, args=("thread",))
thread.start(); thread.join()  # a thread's exit needs libgcc_s, which glibc loads then
assert ctypes.CDLL(None).getpid() > 1
print(sys.version_info[:2], sys.prefix)
r = subprocess.run(["/bin/sh", "-c", "env; echo $0"], env={"PATH": "/bin"}, capture_output=True, text=True)
print(r.stdout)
"""


@pytest.fixture(scope="module")
def busybox_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root with busybox as /bin/sh and the tools drive's runtime, and no libc or Python at all."""
    root = tmp_path_factory.mktemp("busybox-root")
    (root / "bin").mkdir()
    shutil.copy2(BUSYBOX, root / "bin/busybox")
    (root / "bin/sh").symlink_to("busybox")
    runtime, _ = ensure_runtime()
    shutil.copytree(runtime, root / init.TOOLS.lstrip("/"))
    return root


def test_runtime_runs_where_the_image_has_no_libc(busybox_tree: Path) -> None:
    out = subprocess.run(
        [CHROOT, str(busybox_tree), *init.shipped("python3", "-S", "-c", PROBE)],
        env={"PYTHONHOME": init.PYTHON_HOME},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out[0] == "thread"
    assert out[1].startswith("(3, ") and out[1].endswith(init.PYTHON_HOME)
    child = out[2:]
    assert "PATH=/bin" in child and child[-2] == "/bin/sh", "the child runs the image's shell"
    assert not [line for line in child if "PYTHON" in line or line.startswith("LD_")]


def test_sdk_bash_falls_back_to_the_image_s_sh(monkeypatch: pytest.MonkeyPatch) -> None:
    present: set[str] = {"/bin/bash", "/bin/sh"}
    monkeypatch.setattr(os.path, "exists", lambda path: path in present)
    assert process._program("/bin/bash") == "/bin/bash"
    present.discard("/bin/bash")
    assert process._program("/bin/bash") == "/bin/sh"
    assert process._program("/usr/bin/env") == "/usr/bin/env", "only the SDK's shell is replaced"
    present.clear()
    with pytest.raises(ConnectError, match="no shell") as exc:
        process._program("/bin/bash")
    assert exc.value.code == "failed_precondition"


def test_root_exists_without_passwd(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_passwd(name: str):
        raise KeyError(name)

    monkeypatch.setattr(users.pwd, "getpwnam", no_passwd)
    root = users.lookup_user("root")
    assert (root.name, root.uid, root.gid) == ("root", 0, 0)
    with pytest.raises(ConnectError):
        users.lookup_user("user")
