"""Tools drive: the guest's init and envd, their vendored dependencies and the Python runtime they
run on (``aenv.guest.runtime``), on a small ext4 disk.

Kept apart from the Debian root filesystem so that changing envd or init rebuilds only this
image (seconds), never the rootfs (minutes), and so that every template, including ones built
from other images (whatever libc or Python they have, if any), gets the same init and envd.
The guest mounts it read-only at /opt/aenv.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import aenv.agent
from aenv.agent.init import EXEC_HELPER, TOOLS
from aenv.guest.cache import cached_build, file_digest, inputs_key, tree_digest
from aenv.guest.runtime import add_libraries, compile_tree, ensure_runtime, python_version

log = logging.getLogger(__name__)

TOOLS_LABEL = "aenv-tools"
TOOLS_MOUNT = TOOLS
ENVD_PACKAGE = "aenv_envd"
PRODUCT = "tools.img"

AGENT_DIR = Path(aenv.agent.__file__).parent
INIT_SOURCE = AGENT_DIR / "init.py"
ENVD_SOURCE = AGENT_DIR / "envd"
EXEC_SOURCE = AGENT_DIR / "exec.c"

# The one place guest-side Python dependencies are pinned (the host venv's versions, so envd
# runs in the guest with what its tests run on the host), as wheels for the shipped runtime.
VENDORED = (
    "aiohttp==3.14.5",
    "aiohappyeyeballs==2.7.1",
    "aiosignal==1.4.0",
    "attrs==26.1.0",
    "frozenlist==1.8.0",
    "multidict==7.2.1",
    "propcache==0.5.4",
    "yarl==1.25.1",
    "idna==3.20",
    "typing_extensions==4.16.0",
    "uvloop==0.23.0",
)


def tools_key(runtime: str) -> str:
    """Hash of init, envd sources, pins, the runtime's key and this builder: all that decides the
    drive's content."""
    return inputs_key(
        builder=file_digest(Path(__file__)),
        init=file_digest(INIT_SOURCE),
        envd=tree_digest(ENVD_SOURCE),
        exec_helper=file_digest(EXEC_SOURCE),
        vendored=VENDORED,
        runtime=runtime,
    )


def _vendor(lib: Path) -> None:
    """Install the pinned wheels for the guest's interpreter, whatever the host runs."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-compile",
            "--target",
            str(lib),
            "--only-binary=:all:",
            "--python-version",
            python_version(),
            "--platform",
            "manylinux2014_x86_64",
            "--implementation",
            "cp",
            *VENDORED,
        ],
        check=True,
        stdin=subprocess.DEVNULL,
    )
    shutil.rmtree(lib / "bin", ignore_errors=True)
    # Debug sections are never loaded, and they are most of some wheels' extension modules
    # (11.7 of uvloop's 13.6 MB).
    modules = sorted(lib.rglob("*.so"))
    if modules:
        subprocess.run(["strip", "--strip-debug", *map(str, modules)], check=True)


def build_exec_helper(target: Path) -> None:
    """Compile aenv-exec, envd's command starter, static: it runs in every image, whatever libc
    the image has, and starts without a dynamic loader."""
    target.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["cc", "-static", "-Os", "-Wall", "-Werror", "-o", str(target), str(EXEC_SOURCE)],
        check=True,
        stdin=subprocess.DEVNULL,
    )


def _build(runtime: Path, out: Path) -> None:
    tree = out / "tree"
    # Hard links: the runtime's cache entry and this tree are on the same filesystem.
    shutil.copytree(runtime, tree, copy_function=os.link)
    lib = tree / "lib"
    lib.mkdir()
    shutil.copy2(INIT_SOURCE, tree / "init.py")
    build_exec_helper(tree / Path(EXEC_HELPER).relative_to(TOOLS))
    if ENVD_SOURCE.is_dir():
        shutil.copytree(ENVD_SOURCE, lib / ENVD_PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        log.warning("no envd sources at %s: tools drive has no envd", ENVD_SOURCE)
    _vendor(lib)
    add_libraries(tree, lib)
    compile_tree(lib)
    size_mib = sum(p.stat().st_size for p in tree.rglob("*") if p.is_file()) * 2 // (1 << 20) + 16
    subprocess.run(
        [
            "mkfs.ext4",
            "-q",
            "-F",
            "-L",
            TOOLS_LABEL,
            "-m",
            "0",
            "-O",
            "^has_journal",
            "-E",
            "root_owner=0:0",
            "-d",
            str(tree),
            str(out / PRODUCT),
            f"{size_mib}M",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    shutil.rmtree(tree)


def ensure_tools() -> tuple[Path, str]:
    """Path of the cached tools drive (built if missing) and its digest."""
    runtime, runtime_key = ensure_runtime()
    key = tools_key(runtime_key)
    return cached_build("tools", key, lambda out: _build(runtime, out), PRODUCT) / PRODUCT, key
