"""`python -m bench.forward NETNS PORT`: a loopback port forwarded to a guest port, in a process of its own.

The "direct" path of the data-plane figures: a plain byte relay (aenv's `forward_port`) into the
sandbox's namespace, the least any host-side client needs to reach a guest. It runs apart from the
harness, as the node's proxy does, so neither relay competes with the client for one interpreter.
Prints the port it listens on; exits on SIGTERM or when its stdin closes (the harness is gone).
"""

from __future__ import annotations

import asyncio
import signal
import sys

from aenv.network.forward import forward_port
from aenv.network.netns import SandboxNetwork


async def serve(netns: str, guest_port: int) -> None:
    server = await forward_port(SandboxNetwork(netns), guest_port)
    print(server.sockets[0].getsockname()[1], flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_reader(sys.stdin.fileno(), lambda: sys.stdin.buffer.read1(1) or stop.set())
    await stop.wait()
    server.close()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], int(sys.argv[2])))
