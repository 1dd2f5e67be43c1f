"""nft scripts loaded through libnftables, in one helper process of the node's.

Running `nft -f` behind `nsenter` costs two process starts per load (~5 ms of CPU, and about as
much wall time, on a 2-core host), and a node loads rules for every sandbox network it makes.
libnftables is the library `nft` itself is built on (Debian's libnftables1, which the nftables
package depends on). Its netlink socket belongs to the namespace of the thread that opens it,
so the loader enters the sandbox's namespace for each load (`nsthread.inside`).

The library waits for the kernel's answers with select(2), and glibc ends a process whose
select(2) is given a descriptor numbered 1024 (FD_SETSIZE) or more ("bit out of range 0 -
FD_SETSIZE on fd_set"). A node with a few hundred sandboxes holds more descriptors than that,
so the library must not run in the node's process. It runs in one long-lived helper instead
(`python -m aenv.network.nftables`), which holds a handful of descriptors. The node starts it
on its first load, and again on the next load after it exited. Each request is one JSON line
on the helper's stdin (`netns`, `script`), each answer one JSON line on its stdout (`error`,
null when the script was loaded). The helper ends when its stdin closes, which is when the
node exits. The loads go one at a time, from one thread of the node.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import functools
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

from .nsthread import inside

_LOADER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nft")
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # holds the `aenv` package


class NftError(RuntimeError):
    """nft refused a script (the message is its own), libnftables is missing, or the helper
    process could not load it."""


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
    """Load `script` with libnftables in this process (the helper's)."""
    lib = _library()
    with inside(netns) if netns is not None else contextlib.nullcontext():
        ctx = lib.nft_ctx_new(0)
        if not ctx:
            raise NftError("libnftables could not make a context")
        try:
            lib.nft_ctx_buffer_output(ctx)  # kept off the helper's stdout, which carries answers
            lib.nft_ctx_buffer_error(ctx)
            if lib.nft_run_cmd_from_buffer(ctx, script.encode()) != 0:
                raise NftError((lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace").strip())
        finally:
            lib.nft_ctx_free(ctx)


class _Helper:
    """The node's side of the helper process: started when first needed, again after it exited."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def load(self, script: str, netns: str | None) -> None:
        with self._lock:
            process = self._process
            if process is not None and process.poll() is not None:  # exited since its last load
                _discard(process)
                process = None
            process = process or self._start()
            assert process.stdin is not None and process.stdout is not None
            request = json.dumps({"netns": netns, "script": script}).encode() + b"\n"
            try:
                process.stdin.write(request)
                process.stdin.flush()
                answer = process.stdout.readline()
            except OSError:
                answer = b""
            if not answer:
                self._process = None
                raise NftError(f"the nft helper process exited ({_discard(process)}) during a load")
            error = json.loads(answer)["error"]
        if error is not None:
            raise NftError(error)

    def _start(self) -> subprocess.Popen[bytes]:
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), path]))}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "aenv.network.nftables"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )  # fmt: skip
        return self._process

    def close(self) -> None:
        """Close the helper's stdin and wait for it to end."""
        with self._lock:
            process, self._process = self._process, None
        if process is not None:
            assert process.stdin is not None
            with contextlib.suppress(OSError):
                process.stdin.close()
            process.wait()


def _discard(process: subprocess.Popen[bytes]) -> int:
    """Close the pipes to a helper that has exited or is exiting, and return its exit code."""
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
    return process.wait()


_HELPER = _Helper()
atexit.register(_HELPER.close)


async def load(script: str, netns: str | None = None) -> None:
    """Load `script` as one transaction (all of it or nothing), in namespace `netns` when given."""
    await asyncio.get_running_loop().run_in_executor(_LOADER, _HELPER.load, script, netns)


def _serve(requests: IO[bytes], answers: IO[str]) -> None:
    """The helper's loop: one answer line for each request line, until `requests` ends."""
    for line in requests:
        request = json.loads(line)
        try:
            _load(request["script"], request["netns"])
            error = None
        except (NftError, OSError) as exc:
            error = str(exc)
        answers.write(json.dumps({"error": error}) + "\n")
        answers.flush()


if __name__ == "__main__":
    # Answers go to a copy of stdout; anything else that writes to stdout goes to stderr.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    _serve(sys.stdin.buffer, answers)
