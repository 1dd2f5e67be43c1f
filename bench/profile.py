"""`--profile NAME`: the node process sampled by py-spy while one figure runs."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from .node import BenchError

FORMATS = {"speedscope": ".speedscope.json", "flamegraph": ".svg"}


def py_spy() -> str:
    """The py-spy next to this interpreter (the project venv), else the one on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if not found:
        raise BenchError("--profile needs py-spy (pip install py-spy)")
    return found


@contextlib.asynccontextmanager
async def recording(pid: int, output: Path, fmt: str = "speedscope") -> AsyncIterator[Path]:
    """Sample `pid` without pausing it (`--nonblocking`, so the figure is not slowed by the sampler)."""
    process = await asyncio.create_subprocess_exec(
        py_spy(), "record", "--pid", str(pid), "--output", str(output), "--format", fmt, "--nonblocking",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    await asyncio.sleep(1.0)  # attached and sampling
    if process.returncode is not None:
        raise BenchError(
            f"py-spy exited at once: {(await process.communicate())[1].decode(errors='replace')}"
        )
    try:
        yield output
    finally:
        process.send_signal(signal.SIGINT)  # py-spy writes its output when interrupted
        try:
            await asyncio.wait_for(process.communicate(), 60)
        except TimeoutError:
            process.kill()
            await process.wait()
