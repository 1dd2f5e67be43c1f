"""envd and init in images that are not `base`: Debian bullseye (its own older Python and glibc),
busybox alone (no libc, no Python) and busybox with musl (musl the only libc), each booted as a
real VM with the real tools drive and driven by the official SDK.

The whole envd SDK suite (tests/envd/test_sdk.py, as tests/vm/test_envd_sdk_in_vm.py runs it in
`base`) runs in every image, plus what tells the images apart.
"""

from __future__ import annotations

import pytest

from tests.envd.test_sdk import *  # noqa: F403  (the whole envd SDK suite, in every image)

pytestmark = pytest.mark.vm

LOADER = "/opt/aenv/runtime/lib/ld-linux-x86-64.so.2"
# The SDK asks for /bin/bash; an image without it runs the command with its /bin/sh.
SHELL = {"bullseye": "/bin/bash", "busybox": "/bin/sh", "musl": "/bin/sh"}
# Shown in every image with a shell: glibc's or musl's loader, Python, in the places they have.
SYSTEM_FILES = (
    "/lib64/ld-linux-x86-64.so.2 /lib/x86_64-linux-gnu/libc.so.6 /lib/ld-musl-x86_64.so.1 /usr/bin/python3"
)
IMAGE_FILES = {
    "bullseye": ["/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu/libc.so.6", "/usr/bin/python3"],
    "busybox": [],
    "musl": ["/lib/ld-musl-x86_64.so.1"],
}


def test_image_has_only_its_own_system(sandbox, image_name):
    listing = sandbox.commands.run(f'for f in {SYSTEM_FILES}; do [ -e "$f" ] && echo "$f"; done; true')
    assert listing.stdout.split() == IMAGE_FILES[image_name]


def test_commands_run_in_the_image_s_shell(sandbox, image_name):
    assert sandbox.commands.run("echo $0").stdout.strip() == SHELL[image_name]


def test_init_and_envd_run_on_the_shipped_runtime(sandbox):
    """PID 1 and envd (the parent of the command's shell) are the tools drive's loader."""
    for pid in ("1", "$PPID"):
        assert sandbox.commands.run(f"readlink /proc/{pid}/exe", user="root").stdout.strip() == LOADER


def test_children_use_the_image_s_libraries_and_environment(sandbox, image_name):
    env = sandbox.commands.run("env", user="root").stdout
    for leak in ("PYTHONHOME", "PYTHONPATH", "LD_LIBRARY_PATH", "SSL_CERT", "/opt/aenv"):
        assert leak not in env
    assert "/opt/aenv" not in sandbox.commands.run("cat /proc/self/maps").stdout
    if image_name == "bullseye":
        python = sandbox.commands.run("python3 -c 'import sys; print(sys.version_info[:2], sys.prefix)'")
        assert python.stdout.strip() == "(3, 9) /usr"
    if image_name == "musl":
        banner = sandbox.commands.run("/lib/ld-musl-x86_64.so.1 2>&1; true").stdout
        assert banner.startswith("musl libc (x86_64)")


def test_envd_loads_only_the_shipped_libraries(sandbox):
    """Every library envd maps is the tools drive's, with its C extensions among them: a library
    taken from the image (another glibc's libpthread) fails against the shipped libc."""
    maps = sandbox.commands.run("cat /proc/$PPID/maps", user="root").stdout
    files = {line.split()[5] for line in maps.splitlines() if len(line.split()) == 6}
    libraries = {path for path in files if ".so" in path}
    assert libraries and all(path.startswith("/opt/aenv/") for path in libraries), libraries
    for extension in ("uvloop/loop.", "multidict/_multidict.", "aiohttp/_http_parser."):
        assert any(extension in path for path in libraries), extension
