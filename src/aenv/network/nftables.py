"""nft scripts loaded through libnftables, in this process.

Running `nft -f` behind `nsenter` costs two process starts per load (~5 ms of CPU, and about as
much wall time, on a 2-core host), and a node loads rules for every sandbox network it makes.
libnftables is the library `nft` itself is built on (Debian's libnftables1, which the nftables
package depends on). Its netlink socket belongs to the namespace of the thread that opens it,
so the loader thread enters the sandbox's namespace for each load (`nsthread.inside`). There is
one loader thread: the library does not promise that contexts may run in several threads at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import functools

from .nsthread import inside

_LOADER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nft")


class NftError(RuntimeError):
    """nft refused a script (the message is its own), or libnftables is missing."""


@functools.cache
def _library() -> ctypes.CDLL:
    found = ctypes.util.find_library("nftables")
    if found is None:
        raise NftError("libnftables is not installed (Debian: apt install libnftables1)")
    lib = ctypes.CDLL(found)
    lib.nft_ctx_new.restype = ctypes.c_void_p
    lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
    for name in ("nft_ctx_buffer_output", "nft_ctx_buffer_error", "nft_ctx_free"):
        getattr(lib, name).argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
    lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
    lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    return lib


def _load(script: str, netns: str | None) -> None:
    lib = _library()
    with inside(netns) if netns is not None else contextlib.nullcontext():
        ctx = lib.nft_ctx_new(0)
        if not ctx:
            raise NftError("libnftables could not make a context")
        try:
            lib.nft_ctx_buffer_output(ctx)  # kept from this process's stdout
            lib.nft_ctx_buffer_error(ctx)
            if lib.nft_run_cmd_from_buffer(ctx, script.encode()) != 0:
                raise NftError((lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace").strip())
        finally:
            lib.nft_ctx_free(ctx)


async def load(script: str, netns: str | None = None) -> None:
    """Load `script` as one transaction (all of it or nothing), in namespace `netns` when given."""
    await asyncio.get_running_loop().run_in_executor(_LOADER, _load, script, netns)
