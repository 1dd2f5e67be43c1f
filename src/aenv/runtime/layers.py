"""qcow2 layer chains for sandbox disks.

A sandbox writes into its own qcow2 layer whose reads fall through to read-only layers below
(the template's, then the base root filesystem). Layers are created at their final path and
never move, because every qcow2 layer records the path of the layer below it; sealing a layer
(when a snapshot captures it) only means nothing writes to it again, so a snapshot of a disk
costs no copy however much was written. Another home's sealed layers are taken over by
`adopt`, which fixes the recorded paths on copies. Layer ids are random, lowercase and time-ordered.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from ..vmm.launcher import create_upper_layer

_ID_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"


def new_layer_id() -> str:
    millis = int(time.time() * 1000)
    stamp = ""
    while millis:
        millis, digit = divmod(millis, 36)
        stamp = _ID_ALPHABET[digit] + stamp
    return "l" + stamp + secrets.token_hex(5)


class LayerError(RuntimeError):
    """qemu-img failed, or a layer is missing."""


def _failure(args: tuple[str, ...], stderr: bytes) -> LayerError:
    return LayerError(f"qemu-img {args[0]} failed: {stderr.decode(errors='replace').strip()}")


def _qemu_img_sync(*args: str) -> None:
    done = subprocess.run(["qemu-img", *args], capture_output=True, check=False)
    if done.returncode != 0:
        raise _failure(args, done.stderr)


def _link_or_copy(source: Path, target: Path) -> None:
    """`target` becomes `source` by hardlink (a copy across filesystems), appearing at once."""
    staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        os.link(source, staging)
    except OSError:
        shutil.copyfile(source, staging)
    os.replace(staging, target)


class LayerStore:
    """A directory of qcow2 layers named `<id>.qcow2`."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def path(self, layer_id: str) -> Path:
        return self.root / f"{layer_id}.qcow2"

    def exists(self, layer_id: str) -> bool:
        return self.path(layer_id).exists()

    def import_base(self, image: Path, digest: str) -> str:
        """Adopt a read-only base image (a qcow2 without backing file); the same digest is adopted once."""
        layer_id = "b" + digest.removeprefix("sha256:")[:40]
        target = self.path(layer_id)
        if not target.exists():
            _link_or_copy(image, target)
        return layer_id

    def adopt(self, source: LayerStore, chain: Sequence[str]) -> None:
        """Give this store another store's sealed layers `chain` (bottom to top, the bottom one
        without backing file, as a template's are), cheaply and independent of `source`.

        The bottom layer is shared by hardlink. Every layer above records the absolute path of
        the one below, so it is copied (small: what a boot wrote) and the copy rebased onto this
        store's layer; `rebase -u` rewrites only that path. Rebasing a hardlink would change
        the source's layer too. Layers already here are kept.
        """
        for below, layer_id in zip([None, *chain], chain, strict=False):
            target = self.path(layer_id)
            if target.exists():
                continue
            if below is None:
                _link_or_copy(source.path(layer_id), target)
                continue
            staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            try:
                shutil.copyfile(source.path(layer_id), staging)
                _qemu_img_sync(
                    "rebase", "-u", "-f", "qcow2", "-F", "qcow2", "-b", str(self.path(below)), str(staging)
                )
                os.chmod(staging, 0o444)
                os.replace(staging, target)
            finally:
                staging.unlink(missing_ok=True)

    async def create_upper(self, below: str) -> str:
        """A new writable layer on top of layer `below`."""
        return await self.create_upper_over(self.path(below))

    async def create_upper_over(self, backing: Path) -> str:
        """A new writable layer over the sealed qcow2 file `backing` (a layer here or in a cache)."""
        if not backing.exists():
            raise LayerError(f"disk layer {backing.name} is missing")
        layer_id = new_layer_id()
        try:
            await create_upper_layer(backing, self.path(layer_id))
        except RuntimeError as exc:
            raise LayerError(str(exc)) from exc
        return layer_id

    def seal(self, layer_id: str) -> None:
        """Mark a layer read-only: from now on it is shared, never written."""
        os.chmod(self.path(layer_id), 0o444)

    def modified(self, layer_id: str) -> float:
        """When the layer was last written (seconds since the epoch); 0 if it is gone."""
        try:
            return self.path(layer_id).stat().st_mtime
        except FileNotFoundError:
            return 0.0

    def remove(self, layer_id: str) -> None:
        self.path(layer_id).unlink(missing_ok=True)

    def all_ids(self) -> set[str]:
        return {p.name.removesuffix(".qcow2") for p in self.root.glob("*.qcow2")}
