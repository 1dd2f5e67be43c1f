"""README.md's and docs/deploy.md's blocks, run as a reader pastes them (see `blocks`).

Blocks about using a node run against one node on a home seeded with the session's `base`
(the README's `make run` serves forever on :8000 with /var/lib/aenv, so its equivalent is
`aenv.devnode`); a block that starts its own processes (the cluster on one machine) runs them
itself, on free ports, and this module ends them and everything they started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from aenv.devcluster import redis_server
from aenv.devnode import DevNode, free_port, seed_home

from .blocks import DOCUMENTS, NOT_RUN, Block, blocks, marked, substitute
from .conftest import SLOT_COUNT, SLOT_FIRST, Reader, key_file

# The marked blocks, each run by the test of the same name below.
RUN = {"quickstart-sdk", "cli", "code-interpreter", "volumes", "cluster-one-machine", "s3-two-nodes"}


def _pasteable(block: Block) -> bool:
    return block.lang in ("sh", "python")


def test_every_block_is_run_or_says_why_not() -> None:
    found = [b for document in DOCUMENTS for b in blocks(document) if _pasteable(b)]
    names = [b.name for b in found if b.name]
    assert sorted(names) == sorted(RUN), "a docs-test marker without a test, or a test without its block"
    unmarked = [b for b in found if not b.name]
    excuses = {b.first_line: [k for k in NOT_RUN if _excuses(k, b)] for b in unmarked}
    assert all(len(keys) == 1 for keys in excuses.values()), f"one excuse per unmarked block: {excuses}"
    used = {key for keys in excuses.values() for key in keys}
    assert used == set(NOT_RUN), f"excuses for blocks that are gone: {sorted(set(NOT_RUN) - used)}"


def _excuses(key: tuple[str, str], block: Block) -> bool:
    document, start = key
    return block.document == document and (block.text + "\n").startswith(start)


def _node_subs(node: DevNode) -> list[tuple[str, str]]:
    return [("http://127.0.0.1:8000", node.url), ("/var/lib/aenv/secrets/api-key", str(key_file(node)))]


@pytest.mark.vm
def test_quickstart_sdk(clean_node: DevNode, reader: Reader) -> None:
    block = marked("quickstart-sdk")
    result = reader.run(block.lang, substitute(block, _node_subs(clean_node)))
    assert "Linux" in result.stdout and "kept across pause and resume" in result.stdout, result.stdout


@pytest.mark.vm
def test_cli(clean_node: DevNode, reader: Reader) -> None:
    """The interactive shells get `exit` on their input, as a reader would type it; `<id>` is the
    sandbox `aenv start base` reported."""
    block = marked("cli")
    (reader.workdir / "src").mkdir()
    (reader.workdir / "src" / "hello.txt").write_text("from the reader's checkout\n")
    started = "2>start.log; id=$(sed -n 's/^Started sandbox //p' start.log)"
    text = substitute(
        block,
        [
            ("--url http://127.0.0.1:8000", f"--url {clean_node.url}"),
            ("/var/lib/aenv/secrets/api-key", str(key_file(clean_node))),
            ("aenv start base ", f"echo exit | aenv start base {started}; "),
            ("aenv cn <id>", "echo exit | aenv cn <id>"),
            ("aenv start prepared", "echo exit | aenv start prepared"),
            ("<id>", '"$id"'),
        ],
    )
    result = reader.run(block.lang, text)
    assert "Linux" in result.stdout, result.stdout
    downloaded = [p.read_text() for p in (reader.workdir / "out").rglob("hello.txt")]
    assert downloaded == ["from the reader's checkout\n"], result.stderr


@pytest.mark.vm
def test_code_interpreter(clean_node: DevNode, reader: Reader) -> None:
    """The lean build only: the full one pip-installs matplotlib in the guest (minutes under TCG;
    `scripts/code-interpreter-charts.py` checks charts)."""
    block = marked("code-interpreter")
    full_build = ".venv/bin/python templates/code-interpreter/template.py          # with matplotlib"
    chart = 'chart = sandbox.run_code("import matplotlib.pyplot as plt; plt.plot([1, 4, 9]); plt.show()")'
    png = "print(len(chart.results[0].png))"
    lean = ".venv/bin/python templates/code-interpreter/template.py --lean"
    text = substitute(
        block,
        [(full_build, "# " + full_build), ("# " + lean, lean), (chart, "# " + chart), (png, "# " + png)],
    )
    env = {"E2B_API_URL": clean_node.url, "E2B_SANDBOX_URL": clean_node.url, "E2B_API_KEY": clean_node.key}
    try:
        result = reader.run(block.lang, text, **env)
    finally:
        httpx.delete(f"{clean_node.url}/templates/code-interpreter-v1", headers={"X-API-Key": clean_node.key})
    assert "\n2\n" in result.stdout and "ZeroDivisionError" in result.stdout, result.stdout


@pytest.mark.vm
def test_volumes(clean_node: DevNode, reader: Reader) -> None:
    block = marked("volumes")
    url = clean_node.url
    env = {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_VOLUME_API_URL": url}
    env["E2B_API_KEY"] = clean_node.key
    try:
        result = reader.run(block.lang, block.text, **env)
    finally:
        _kill_sandboxes_and_volumes(clean_node)
    assert "seen by b at once" in result.stdout, result.stdout


def _kill_sandboxes_and_volumes(node: DevNode) -> None:
    with httpx.Client(base_url=node.url, headers={"X-API-Key": node.key}, timeout=120) as api:
        for sandbox in api.get("/v2/sandboxes", params={"state": "running,paused", "limit": 100}).json():
            api.delete(f"/sandboxes/{sandbox['sandboxID']}")
        for volume in api.get("/volumes").json():
            api.delete(f"/volumes/{volume['volumeID']}")


class Shell:
    """A block that starts long-running processes, run in bash in a process group of its own."""

    def __init__(self, reader: Reader, text: str, log: Path, **env: str) -> None:
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                ["bash", "-c", text], cwd=reader.workdir, env={**reader.env, **env},
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self, timeout: float = 120) -> None:
        """SIGTERM to every process of the block (a node ends its sandboxes), SIGKILL after `timeout`."""
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 30)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                try:
                    os.killpg(self.proc.pid, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.2)
                self.proc.poll()


def _wait_for(what: str, check, shell: Shell, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
            if value:
                return value
        except httpx.HTTPError:
            pass
        if shell.proc.poll() is not None and shell.proc.returncode is not None:
            pytest.fail(f"the block ended before {what}:\n{shell.tail()}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}:\n{shell.tail()}")
        time.sleep(1)


def _sdk_round_trip(url: str, key: str) -> str:
    from e2b import Sandbox

    sandbox = Sandbox.create(api_url=url, sandbox_url=url, api_key=key, timeout=120)
    try:
        return sandbox.commands.run("echo usable").stdout
    finally:
        sandbox.kill()


@pytest.mark.vm
def test_cluster_one_machine(reader: Reader, template_seed: Path, tmp_path: Path) -> None:
    """docs/deploy.md's cluster from one checkout: scheduler, gateway and a node, on free ports and
    a Redis of its own, the node on a home seeded with `base`; a sandbox through the gateway."""
    block = marked("cluster-one-machine")
    key_line = "export AENV_API_KEY=e2b_$(od -An -N32 -tx1 /dev/urandom | tr -d ' \\n')"
    scheduler, gateway, node = (f"127.0.0.1:{free_port()}" for _ in range(3))
    text = substitute(
        block,
        [
            (key_line, f'{key_line}; echo "$AENV_API_KEY" > api-key'),
            ("http://127.0.0.1:9090", f"http://{scheduler}"),
        ],
    )
    home = tmp_path / "home"
    seed_home(home, template_seed)
    first = SLOT_FIRST + SLOT_COUNT
    leftovers = DevNode(home, slot_first=first, slot_count=SLOT_COUNT)  # its cleanup, never started
    with redis_server(tmp_path / "redis") as redis:
        env = {
            "AENV_REDIS_URL": redis.url, "AENV_SCHEDULER_ADDR": scheduler, "AENV_GATEWAY_ADDR": gateway,
            "AENV_API_ADDR": node, "AENV_HOME_PATH": str(home), "AENV_SLOT_FIRST": str(first),
            "AENV_SLOT_COUNT": str(SLOT_COUNT), "AENV_WARM_POOL_SIZE": "1", "AENV_SHUTDOWN_ACTION": "kill",
        }  # fmt: skip
        shell = Shell(reader, text, tmp_path / "cluster.log", **env)
        try:
            key = _wait_for("the API key", lambda: _read(reader.workdir / "api-key"), shell)
            through = f"http://{gateway}"
            out = _wait_for("a sandbox via the gateway", lambda: _try(_sdk_round_trip, through, key), shell)
            assert out == "usable\n"
        finally:
            shell.stop()
            forced = leftovers.cleanup()
            assert not forced, f"left behind: {forced}\n{shell.tail()}"


def _read(path: Path) -> str | None:
    return path.read_text().strip() if path.exists() and path.read_text().strip() else None


def _try(call, *args):
    """The call's result, or None while the cluster is still starting (no node registered yet)."""
    from e2b import SandboxException

    try:
        return call(*args)
    except SandboxException as exc:
        if str(exc).startswith("500"):
            raise  # a node that is up and failing: waiting longer would not help
        return None


def _weed_ports(workdir: Path) -> tuple[str, int]:
    """`weed server` flags for free ports only (the block's defaults, 9333, 8080, 8888 and their
    gRPC ports, may be taken on a shared host) and a filer socket of its own; the S3 port."""
    ports = {name: free_port() for name in ("master", "volume", "filer", "s3")}
    flags = [f"-{name}.port={port} -{name}.port.grpc={free_port()}" for name, port in ports.items()]
    flags += ["-s3.port.iceberg=0 -s3.port.lance=0", f"-filer.localSocket={workdir / 'filer.sock'}"]
    return " ".join(flags), ports["s3"]


@pytest.mark.vm
def test_s3_two_nodes(reader: Reader, tmp_path: Path) -> None:
    """The README's two nodes on one SeaweedFS, from fresh homes (each node finds or builds `base`
    through the bucket): a sandbox on each."""
    block = marked("s3-two-nodes")
    weed = tmp_path / "weed"
    flags, s3_port = _weed_ports(weed)
    homes = tmp_path / "aenv-a", tmp_path / "aenv-b"
    ports = free_port(), free_port()
    first = SLOT_FIRST + 2 * SLOT_COUNT, SLOT_FIRST + 3 * SLOT_COUNT
    text = substitute(
        block,
        [
            ("/tmp/weed", str(weed)),
            ("-s3.port=8333", flags),
            ("http://127.0.0.1:8333", f"http://127.0.0.1:{s3_port}"),
            ("/dev/tcp/127.0.0.1/8333", f"/dev/tcp/127.0.0.1/{s3_port}"),
            ("s3://aenv/cluster", f"s3://aenv/docs-{os.getpid()}"),
            ("/var/lib/aenv-a", str(homes[0])),
            ("/var/lib/aenv-b", str(homes[1])),
            ("127.0.0.1:8000", f"127.0.0.1:{ports[0]}"),
            ("127.0.0.1:8001", f"127.0.0.1:{ports[1]}"),
            ("AENV_SLOT_FIRST=0 ", f"AENV_SLOT_FIRST={first[0]} AENV_SLOT_COUNT={SLOT_COUNT} "),
            ("AENV_SLOT_FIRST=1024 ", f"AENV_SLOT_FIRST={first[1]} AENV_SLOT_COUNT={SLOT_COUNT} "),
        ],
    )
    key = "e2b_docs" + os.urandom(8).hex()
    leftovers = [DevNode(h, slot_first=f, slot_count=SLOT_COUNT) for h, f in zip(homes, first, strict=True)]
    # `wait`: the block's servers run in the background, as in a reader's shell that stays open.
    settings = {"AENV_API_KEY": key, "AENV_SHUTDOWN_ACTION": "kill", "AENV_WARM_POOL_SIZE": "1"}
    shell = Shell(reader, text + "\nwait\n", tmp_path / "s3.log", **settings)
    try:
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for url in urls:
            out = _wait_for(f"a sandbox on {url}", lambda u=url: _try(_sdk_round_trip, u, key), shell, 600)
            assert out == "usable\n"
    finally:
        shell.stop()
        forced = [what for node in leftovers for what in node.cleanup()]
        assert not forced, f"left behind: {forced}\n{shell.tail()}"
