"""One thread inside a named network namespace, for the length of a `with` block.

setns(2) moves only the calling thread, so the rest of the process (the event loop, other
threads) stays where it is. Sockets keep the namespace they were made in, which is how the node
reaches guests and loads their rules without a helper process.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

CLONE_NEWNET = 0x40000000

libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def inside(name: str) -> Iterator[None]:
    """Run the body with this thread in namespace `name`, then return to the original one."""
    original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(original)
    finally:
        os.close(target)
        os.close(original)
