"""Data-plane figures: the node's sandbox proxy against a direct path to the same guest port.

"Direct" is a loopback port forwarded by a plain byte relay into the sandbox's namespace
(`bench.forward`, a process of its own), which is the floor for any host-side client: the guest
is only reachable inside that namespace. Both paths are driven by the same client code, samples
alternate between them so drift affects both alike, and the direct one needs the node's host
(a remote node reports it as n/a).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from .client import ENVD_PORT
from .context import Context, Sandboxes
from .node import REPO, BenchError
from .report import Row
from .stats import summarize

HTTP_PORT = 8000
WWW = "/root/www"
WARM_MIB = 16
DIRECT = "direct: loopback port relayed into the sandbox's namespace"
NO_DIRECT = "direct: n/a (needs the node's host)"


@contextlib.asynccontextmanager
async def forwarded(netns: str, guest_port: int) -> AsyncIterator[str]:
    """The URL of a loopback port relayed to `guest_port` of the guest in `netns`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "src")])}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.forward", netns, str(guest_port),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=REPO, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 30)
        if not line.strip().isdigit():
            raise BenchError(f"the port forwarder did not start (exit status {process.returncode})")
        yield f"http://127.0.0.1:{int(line)}"
    finally:
        if process.returncode is None:
            process.terminate()
        await process.wait()


async def proxy_rtt(ctx: Context) -> list[Row]:
    """`commands.run("true")` with the official SDK (`AsyncSandbox`), through the node and direct."""
    from e2b import AsyncSandbox

    rounds = ctx.plan.proxy_rtt
    node = ctx.node
    samples: dict[str, list[float]] = {"proxy": [], "direct": []}
    async with Sandboxes(ctx.client) as sandboxes, contextlib.AsyncExitStack() as stack:
        sandbox = await sandboxes.create()
        sandbox_id = sandbox["sandboxID"]
        params: dict[str, Any] = {"api_key": node.api_key, "api_url": node.url}
        paths = {"proxy": await AsyncSandbox.connect(sandbox_id, sandbox_url=node.url, **params)}
        if node.local:
            direct_url = await stack.enter_async_context(
                forwarded(node.state(sandbox_id)["network_name"], ENVD_PORT)
            )
            paths["direct"] = await AsyncSandbox.connect(sandbox_id, sandbox_url=direct_url, **params)
        for sdk in paths.values():  # open connections and warm both paths up
            for _ in range(3):
                await sdk.commands.run("true")
        for i in range(rounds):
            order = list(paths.items())
            for name, sdk in order if i % 2 else reversed(order):
                started = time.perf_counter()
                await sdk.commands.run("true")
                samples[name].append((time.perf_counter() - started) * 1000)
    direct = statistics.median(samples["direct"]) if samples["direct"] else None
    note = f"official e2b AsyncSandbox; {DIRECT if direct else NO_DIRECT}"
    details: dict[str, Any] = {}
    if samples["direct"]:
        details["direct"] = summarize("direct", samples["direct"]).as_dict()
    figure = summarize('proxy round trip (commands.run("true"))', samples["proxy"])
    return [Row("proxy-rtt", figure, direct, "direct", note=note, details=details)]


async def _download(client: httpx.AsyncClient, url: str, headers: dict[str, str], size: int) -> float:
    """MB/s of one GET of the file (10^6 bytes per MB)."""
    received = 0
    started = time.perf_counter()
    async with client.stream("GET", url, headers=headers) as response:
        if response.status_code != 200:
            raise BenchError(f"GET {url} answered {response.status_code}: {(await response.aread())[:200]!r}")
        async for chunk in response.aiter_raw():
            received += len(chunk)
    elapsed = time.perf_counter() - started
    if received != size:
        raise BenchError(f"GET {url}: got {received} bytes of {size}")
    return received / elapsed / 1e6


async def proxy_throughput(ctx: Context) -> list[Row]:
    """A file served by `python3 -m http.server` in the guest, downloaded through the node and direct."""
    mib = ctx.plan.throughput_mib
    size = mib << 20
    node = ctx.node
    samples: dict[str, list[float]] = {"proxy": [], "direct": []}
    async with Sandboxes(ctx.client) as sandboxes, contextlib.AsyncExitStack() as stack:
        sandbox = await sandboxes.create()
        sandbox_id = sandbox["sandboxID"]
        # Sparse files, read once so the guest serves them from its page cache (when they fit):
        # no disk I/O, and nothing compresses them on the way. `warm` is downloaded once by each
        # path, untimed, so no timed download pays for first use (under TCG: the guest translating
        # the server's code, the relays' first connections).
        await ctx.client.run(
            sandbox,
            f"mkdir -p {WWW} && truncate -s {mib}M {WWW}/blob && truncate -s {WARM_MIB}M {WWW}/warm && "
            f"cat {WWW}/blob >/dev/null && (setsid python3 -m http.server {HTTP_PORT} --bind 0.0.0.0 "
            f"--directory {WWW} </dev/null >/dev/null 2>&1 &) && "
            f"for i in $(seq 300); do curl -sfIo /dev/null localhost:{HTTP_PORT}/blob && exit 0; "
            f"sleep 0.1; done; exit 1",
        )
        routing = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(HTTP_PORT)}
        paths = {"proxy": (node.url, routing)}
        if node.local:
            direct_url = await stack.enter_async_context(
                forwarded(node.state(sandbox_id)["network_name"], HTTP_PORT)
            )
            paths["direct"] = (direct_url, {})
        timeout = httpx.Timeout(600.0, connect=30.0)
        async with httpx.AsyncClient(timeout=timeout) as client:
            for url, headers in paths.values():
                await _download(client, f"{url}/warm", headers, WARM_MIB << 20)
            for i in range(ctx.plan.throughput_rounds):
                order = list(paths.items())
                for name, (url, headers) in order if i % 2 else reversed(order):
                    samples[name].append(await _download(client, f"{url}/blob", headers, size))
    direct = statistics.median(samples["direct"]) if samples["direct"] else None
    size_text = f"{mib} MiB" if mib < 1024 else f"{mib >> 10} GiB"
    note = (
        f"a {size_text} sparse file from python3 -m http.server in the guest, routed by the "
        f"E2b-Sandbox-Id/-Port headers; {DIRECT if direct else NO_DIRECT}; ratio = proxy / direct"
    )
    details = {"direct_mb_s": samples["direct"]}
    figure = summarize(f"proxy throughput ({size_text} download)", samples["proxy"], unit="MB/s")
    return [Row("proxy-throughput", figure, direct, "direct", note=note, details=details)]
