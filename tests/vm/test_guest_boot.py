"""A cold boot of the base guest: init, network, users and envd, then a clean shutdown."""

from __future__ import annotations

import secrets

from aenv.agent.envd import ENVD_PORT
from aenv.network.forward import forward_port
from aenv.vmm.launcher import boot_base_guest


def test_cold_boot_and_clean_shutdown(guest_artifacts, node_loop, tmp_path):
    name = "boot" + secrets.token_hex(3)
    guest = node_loop.run(boot_base_guest(guest_artifacts, tmp_path / "vm", name=name))
    try:
        server = node_loop.run(forward_port(guest.network, ENVD_PORT))
        port = server.sockets[0].getsockname()[1]
        from e2b import Sandbox
        from e2b.connection_config import ConnectionConfig
        from packaging.version import Version

        from aenv.agent.envd import ENVD_VERSION

        config = ConnectionConfig(
            debug=True,
            sandbox_url=f"http://127.0.0.1:{port}",
            extra_sandbox_headers={"E2b-Sandbox-Id": name, "E2b-Sandbox-Port": "49983"},
        )
        sandbox = Sandbox(
            sandbox_id=name, sandbox_domain=None, envd_version=Version(ENVD_VERSION),
            envd_access_token=None, traffic_access_token=None, connection_config=config,
        )  # fmt: skip
        who = sandbox.commands.run("id -u; id -un; echo $HOME; pwd; hostname; sudo -n id -u")
        assert who.stdout.split() == ["1000", "user", "/home/user", "/home/user", name, "0"]
        tools = sandbox.commands.run("python3 -m venv -h >/dev/null && pip -V && git --version && curl -V")
        assert tools.exit_code == 0
        net = sandbox.commands.run("ip -4 -o addr show eth0; ip route; cat /etc/resolv.conf")
        assert "169.254.0.21/30" in net.stdout and "default via 169.254.0.22" in net.stdout
        assert "nameserver" in net.stdout
        info = sandbox.files.write("hello.txt", "hi")
        assert info.path == "/home/user/hello.txt"
        assert sandbox.commands.run("stat -c %U:%G /home/user/hello.txt").stdout.strip() == "user:user"
        serial = guest.vm.serial_log.read_text(errors="replace")
        assert "aenv-initramfs: root" in serial and "envd started" in serial
        node_loop.loop.call_soon_threadsafe(server.close)
        assert node_loop.run(guest.shutdown()), "the guest did not shut down by itself"
    finally:
        node_loop.run(guest.destroy())
