"""`aenv upload` / `aenv download`: files and directory trees, streamed through envd's `/files`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import posixpath
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from . import output
from .common import api
from .config import CLIError
from .envd import Envd

CHUNK = 256 * 1024
MAX_DEPTH = 64
DIRECTORY = "FILE_TYPE_DIRECTORY"


def register(commands: argparse._SubParsersAction) -> None:
    upload = commands.add_parser(
        "upload", aliases=["cp-to"], help="copy a local file or directory into a sandbox",
        description="Copies LOCAL to REMOTE like `cp -r`: into REMOTE when it is an existing directory "
        "(or ends with /), as REMOTE otherwise. Relative remote paths start at the user's home.",
    )  # fmt: skip
    upload.add_argument("sandbox_id")
    upload.add_argument("local", type=Path)
    upload.add_argument("remote", nargs="?", default="~", help="destination (default: the home directory)")
    upload.add_argument("-u", "--user", help="owner of the created files (default: `user`)")
    upload.set_defaults(run=run_upload)
    download = commands.add_parser(
        "download", aliases=["cp-from"], help="copy a file or directory out of a sandbox",
        description="Copies REMOTE to LOCAL (default: its name in the current directory); into LOCAL "
        "when it is an existing directory. Existing files are kept unless --force.",
    )  # fmt: skip
    download.add_argument("sandbox_id")
    download.add_argument("remote")
    download.add_argument("local", type=Path, nargs="?")
    download.add_argument("-u", "--user", help="read as this user (default: `user`)")
    download.add_argument("-f", "--force", action="store_true", help="overwrite existing local files")
    download.set_defaults(run=run_download)


def _warn(message: str) -> None:
    print(f"aenv: warning: {message}", file=sys.stderr)


def _running(sandbox_id: str) -> tuple[str, dict[str, Any]]:
    client = api()
    sandbox = client.sandbox(sandbox_id)
    if sandbox.get("state") == "paused":
        raise CLIError(f"sandbox {sandbox_id} is paused; run `aenv resume {sandbox_id}` first")
    return client.url, sandbox


# -- upload ----------------------------------------------------------------------------------


def _local_tree(root: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """Directories and (file, size) below `root`, relative; links and special files are skipped."""
    dirs: list[str] = []
    files: list[tuple[str, int]] = []
    for here, subdirs, names in os.walk(root, onerror=lambda e: _warn(f"cannot read {e.filename}")):
        rel_here = os.path.relpath(here, root)
        for name in sorted(subdirs):
            path = os.path.join(here, name)
            if os.path.islink(path):
                _warn(f"skipping symbolic link {path}")
            else:
                dirs.append(os.path.normpath(os.path.join(rel_here, name)))
        for name in sorted(names):
            path = os.path.join(here, name)
            if os.path.islink(path) or not os.path.isfile(path):
                _warn(f"skipping {path}: not a regular file")
                continue
            files.append((os.path.normpath(os.path.join(rel_here, name)), os.path.getsize(path)))
    return dirs, files


async def _read(path: Path, progress: output.Progress) -> AsyncIterator[bytes]:
    with path.open("rb") as f:
        while chunk := await asyncio.to_thread(f.read, CHUNK):
            progress.advance(len(chunk))
            yield chunk


async def upload(envd: Envd, local: Path, remote: str) -> dict[str, Any]:
    if not local.exists():
        raise CLIError(f"{local} does not exist")
    entry = await envd.stat(remote)
    into = remote.endswith("/") or (entry is not None and entry["type"] == DIRECTORY)
    base = entry["path"] if entry is not None else remote.rstrip("/") or "/"
    target = posixpath.join(base, local.resolve().name) if into else base
    if local.is_dir():
        if not into and entry is not None:
            raise CLIError(f"cannot copy directory {local} onto file {entry['path']} in the sandbox")
        dirs, files = _local_tree(local)
    elif local.is_file():
        dirs, files = [], [("", local.stat().st_size)]
    else:
        raise CLIError(f"{local} is not a regular file or directory")
    progress = output.Progress(f"{local} -> {target}", sum(size for _, size in files))
    try:
        if local.is_dir():
            for rel in [".", *dirs]:
                await envd.make_dir(posixpath.normpath(posixpath.join(target, rel)))
        for rel, size in files:
            source = local / rel if rel else local
            await envd.upload(posixpath.join(target, rel) if rel else target, _read(source, progress), size)
    finally:
        progress.close()
    return {"path": target, "files": len(files), "bytes": progress.total}


def run_upload(args: argparse.Namespace) -> int:
    url, sandbox = _running(args.sandbox_id)

    async def go() -> dict[str, Any]:
        envd = Envd(url, sandbox, args.user)
        try:
            return await upload(envd, args.local, args.remote)
        finally:
            await envd.aclose()

    result = asyncio.run(go())
    message = f"Uploaded {result['files']} file(s), {output.size(result['bytes'])}, to {result['path']}"
    output.done(result, message, args.output)
    return 0


# -- download --------------------------------------------------------------------------------


async def _fetch(envd: Envd, remote: str, local: Path, progress: output.Progress) -> None:
    """Into a temporary file renamed into place: an interrupted copy never looks complete."""
    local.parent.mkdir(parents=True, exist_ok=True)
    partial = local.with_name(f".{local.name}.aenv-partial")
    try:
        with partial.open("wb") as f:
            async for chunk in envd.download(remote):
                await asyncio.to_thread(f.write, chunk)
                progress.advance(len(chunk))
        os.replace(partial, local)
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()


async def download(envd: Envd, remote: str, local: Path | None, force: bool) -> dict[str, Any]:
    entry = await envd.stat(remote)
    if entry is None:
        raise CLIError(f"{remote} does not exist in sandbox {envd.sandbox_id}")
    name = posixpath.basename(entry["path"].rstrip("/")) or "root"
    target = Path(name) if local is None else local / name if local.is_dir() else local
    files: list[tuple[str, Path, int]] = []
    dirs: list[Path] = []
    if entry["type"] == DIRECTORY:
        if target.exists() and not target.is_dir():
            raise CLIError(f"cannot copy directory {entry['path']} onto file {target}")
        dirs.append(target)
        for item in await envd.list_dir(entry["path"], MAX_DEPTH):
            rel = posixpath.relpath(item["path"], entry["path"])
            if item.get("isSymlink"):
                _warn(f"skipping symbolic link {item['path']}")
            elif item["type"] == DIRECTORY:
                dirs.append(target / rel)
            else:
                files.append((item["path"], target / rel, int(item.get("size", 0))))
    else:
        files.append((entry["path"], target, int(entry.get("size", 0))))
    existing = [str(path) for _, path, _ in files if path.exists()]
    if existing and not force:
        more = f" and {len(existing) - 1} more" if len(existing) > 1 else ""
        raise CLIError(f"{existing[0]}{more} already exist(s); use --force to overwrite")
    progress = output.Progress(f"{entry['path']} -> {target}", sum(size for _, _, size in files))
    try:
        for path in dirs:
            path.mkdir(parents=True, exist_ok=True)
        for remote_path, local_path, _ in files:
            await _fetch(envd, remote_path, local_path, progress)
    finally:
        progress.close()
    return {"path": str(target), "files": len(files), "bytes": progress.done}


def run_download(args: argparse.Namespace) -> int:
    url, sandbox = _running(args.sandbox_id)

    async def go() -> dict[str, Any]:
        envd = Envd(url, sandbox, args.user)
        try:
            return await download(envd, args.remote, args.local, args.force)
        finally:
            await envd.aclose()

    result = asyncio.run(go())
    message = f"Downloaded {result['files']} file(s), {output.size(result['bytes'])}, to {result['path']}"
    output.done(result, message, args.output)
    return 0
