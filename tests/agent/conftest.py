"""A guest booted from each test image (tests/agent/images.py) with the real kernel, initramfs and
tools drive, and the official SDK bound to its envd: the fixtures `tests/envd/test_sdk.py` needs.

One image's VM runs at a time: the fixture is parametrized at session scope, so pytest runs every
test of one image, then shuts that VM down before booting the next.
"""

from __future__ import annotations

import dataclasses
import secrets
from types import SimpleNamespace

import pytest

from tests.agent.images import RECIPES, image_disk
from tests.conftest import RunningSandbox
from tests.vm.conftest import workdir  # noqa: F401  (the same per-test directory as in `base`)


@pytest.fixture(scope="session", params=sorted(RECIPES))
def image_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def image_sandbox(image_name, guest_artifacts, node_loop, tmp_path_factory):
    """A cold-booted guest of the image, its envd initialised with a token and forwarded to loopback."""
    from aenv.agent.envd import ENVD_PORT
    from aenv.network.forward import forward_port
    from aenv.vmm.envd_link import utc_timestamp
    from aenv.vmm.launcher import boot_base_guest

    artifacts = dataclasses.replace(guest_artifacts, base_image=image_disk(image_name))
    name = f"{image_name[:6]}{secrets.token_hex(3)}"
    guest = node_loop.run(boot_base_guest(artifacts, tmp_path_factory.mktemp(image_name) / "vm", name=name))
    server = None
    try:
        token = secrets.token_hex(16)
        # As the node does: the token, and the wall clock (microvm has no RTC to read it from).
        node_loop.run(guest.envd.init({"accessToken": token, "timestamp": utc_timestamp()}))
        server = node_loop.run(forward_port(guest.network, ENVD_PORT))
        port = server.sockets[0].getsockname()[1]
        yield RunningSandbox(SimpleNamespace(sandbox_id=name, guest=guest), f"http://127.0.0.1:{port}", token)
    finally:
        if server is not None:
            node_loop.loop.call_soon_threadsafe(server.close)
        node_loop.run(guest.destroy())


@pytest.fixture(scope="session")
def sandbox(image_sandbox: RunningSandbox):
    return image_sandbox.sdk()
