"""On-demand loading: a snapshot's large blobs as files that fill as QEMU reads them.

A node that starts a sandbox from a snapshot whose memory image is not in its runtime cache
does not wait for the image: QEMU maps a file of this node's FUSE filesystem instead
(``<home>/runtime/lazy/<hex>``), and each page the guest touches that the kernel does not hold
yet becomes a read of this filesystem, served from the cache's sparse copy of the blob and, for
chunks it lacks, from ranged reads of the repository, verified chunk by chunk
(`aenv.repository.chunks`). The kernel, initramfs, tools image and the bottom disk layer are
served the same way. Prefetch makes the usual case cheap: device state and the restorable
stream are small blobs fetched whole before QEMU starts, and the chunks a restore read are
recorded once per blob (by the first node that restores from it, ``profiles/<hex>`` in the
repository) and fetched in a few parallel ranged reads before QEMU starts on every later cold
node (`aenv.runtime.resolvers.CachedRuntime`).

Decisions, and why:

- FUSE, for files read as stored. QEMU maps a memory image with ``memory-backend-file`` (a
  private, copy-on-write mapping), which works the same under TCG and KVM, and a FUSE file has
  one page cache per node that every clone's mapping shares, as a local file does; the server
  drops its own copy of what it served (``POSIX_FADV_DONTNEED``). ``userfaultfd`` cannot serve
  a private file mapping, and this kernel has no NBD or ublk. A qcow2 layer above the bottom
  records its backing file by path, which each node rewrites in the header (``qemu-img rebase
  -u``), so it is not its blob's bytes: upper layers (small) are fetched whole; the bottom one
  (the template's root filesystem, most of a chain's bytes) names no backing file and is served
  on demand.
- The server is its own process (``python -m aenv.runtime.lazyfs``) in a session of its own,
  like QEMU, and it lives exactly as long as its node process: it watches the node (a pidfd)
  and, when the node ends however it ends (SIGKILL too), unmounts and exits. A server left
  behind (as it once was, on purpose, for the QEMUs that outlive a crashed node) kept a mount
  and the store's credentials on a home no node ran (issue 32). The price: a QEMU a killed node
  left running gets SIGBUS at its next page not fetched yet. A node attaches only to a server it
  started; a server or a dead mount left by an earlier node process is removed before it
  starts its own.
- The mount sits under ``<home>/runtime``, which VMMs see through their own root
  (`aenv.vmm.mountview`): the node mounts it before that root is built, so it is part of it;
  ``allow_other`` lets the unprivileged VMM user read it.
- Integrity: every chunk is checked against the blob's chunk index before it is written or
  served; a bad chunk is an I/O error to the reader (the guest's QEMU faults), never data. The
  index comes from the repository beside the blob, written by the node that stored the blob.
- Capacity: the sparse copy is an ordinary cache entry (`aenv.runtime.cache`), counted by the
  space it holds and pinned while a lease holds its snapshot; an evicted copy's file is started
  afresh on the next read. The chunk indexes of the served images are small files in
  ``<home>/lazy/index``, written by the node; the server only reads them.
- If the server is down, a node does not start new sandboxes on its files: it fetches the image
  whole instead (`CachedRuntime`).
- Limit, measured (TCG, 512 MiB `base`, 127 MiB of it non-zero): a restore reads most of the
  memory image before its envd answers, about 92 % of the image's non-zero chunks at 256 KiB
  and the same at 64 KiB, so it is not the chunk size; writing a snapshot's delta pages into
  the clone (`aenv.snapshot.memory`) is a copy-on-write fault that reads each page's original
  too. What on-demand loading saves before ready is the rest: the bottom disk layer, the
  kernel and the tools image stay almost unread (about 1 MiB of their 340 MiB): 125 MiB is
  fetched against 489 MiB whole, and a cold create takes 1.8 s with the profile prefetched
  (2.5 s without) against 3.0 s.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import logging
import os
import select
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

from .. import logs
from ..repository.chunks import ChunkFile, ChunkIndex
from ..repository.location import S3Location
from ..repository.s3objects import BlobReader

log = logging.getLogger(__name__)

STATE_DIR = "lazy"  # under the node's home: pid file, log, chunk indexes
MOUNT_DIR = "runtime/lazy"  # under the node's home: inside the VMMs' root (aenv.vmm.mountview)
LOCATION_ENV = "AENV_LAZYFS_S3"
MODULE = "aenv.runtime.lazyfs"
PID_FILE = "lazyfs.pid"
LOG_FILE = "lazyfs.log"
START_TIMEOUT = 30.0
FOREVER = 365 * 86400.0  # attribute cache: the files are immutable


def _mounted(mountpoint: Path) -> bool:
    """Whether something is mounted at `mountpoint` in this namespace, even if it no longer answers."""
    target = str(mountpoint).encode()
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", "rb") as f:
        return any(line.split(b" ")[4] == target for line in f)
    return False


def _answers(mountpoint: Path) -> bool:
    try:
        os.statvfs(mountpoint)
    except OSError:
        return False
    return True


class LazyMount:
    """This node's FUSE server: started once per node process, ending with it.

    `state` holds the pid file, log and chunk indexes; `cache_root` the sparse copies the server
    fills (the runtime cache's directory); `mountpoint` is where QEMU finds the files.
    """

    def __init__(self, state: Path, mountpoint: Path, cache_root: Path, location: S3Location):
        self.state = state
        self.mountpoint = mountpoint
        self.cache_root = cache_root
        self.location = location
        self.reader = BlobReader(location)
        self.index_dir = state / "index"
        self._lock = threading.Lock()

    @classmethod
    def for_home(cls, home: Path, cache_root: Path, location: S3Location) -> LazyMount:
        return cls(home / STATE_DIR, home / MOUNT_DIR, cache_root, location)

    def path(self, key: str) -> Path:
        return self.mountpoint / key

    def publish(self, key: str, index: ChunkIndex) -> None:
        """Let the server serve blob `key` (its data file in the cache) by this index."""
        target = self.index_dir / f"{key}.json"
        if not target.exists():
            tmp = target.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(index.to_json())
            os.replace(tmp, target)

    def withdraw(self, key: str) -> None:
        """The cache dropped the entry: new opens of it fail (open files keep working)."""
        (self.index_dir / f"{key}.json").unlink(missing_ok=True)

    def alive(self) -> bool:
        """Whether this process's server runs and its mount is there (not asked through the
        mount: a server busy fetching must not hold up the node)."""
        pid = server_pid(self.state)
        return pid is not None and _parent(pid) == os.getpid() and _mounted(self.mountpoint)

    def ensure(self) -> None:
        """Start this process's server, unless it runs (a dead one's mount, or a server an earlier
        node process left, is removed first)."""
        with self._lock:
            if self.alive():
                return
            if _mounted(self.mountpoint) or server_pid(self.state) is not None:
                log.warning("removing the lazy-loading server and mount %s left behind", self.mountpoint)
                stop_server(self.state, self.mountpoint)
            self.index_dir.mkdir(parents=True, exist_ok=True)
            self.mountpoint.mkdir(parents=True, exist_ok=True)
            self._start()

    def stop(self) -> None:
        stop_server(self.state, self.mountpoint)

    def _start(self) -> None:
        # The server runs this very package (cwd is /, so a relative PYTHONPATH would not do).
        package_root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH"))))
        env = {**os.environ, "PYTHONPATH": path, LOCATION_ENV: json.dumps(dataclasses.asdict(self.location))}
        args = [sys.executable, "-m", MODULE, str(self.state), str(self.mountpoint), str(self.cache_root),
                f"--node={os.getpid()}"]  # fmt: skip
        with open(self.state / LOG_FILE, "ab") as out:
            process = subprocess.Popen(
                args, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                cwd="/", start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT
        while not (_mounted(self.mountpoint) and _answers(self.mountpoint)):
            if process.poll() is not None or time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                tail = (self.state / LOG_FILE).read_text(errors="replace")[-2000:]
                raise OSError(f"the lazy-loading server did not mount {self.mountpoint}: {tail}")
            time.sleep(0.05)
        (self.state / PID_FILE).write_text(str(process.pid))
        log.info("lazy loading through %s (server pid %d)", self.mountpoint, process.pid)


def server_pid(state: Path) -> int | None:
    """The pid of the server of `state`, if it runs (its command line names the state directory)."""
    try:
        pid = int((state / PID_FILE).read_text())
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    return pid if MODULE.encode() in argv and str(state).encode() in argv else None


def _parent(pid: int) -> int | None:
    """The parent pid of `pid` (the fourth field of /proc/<pid>/stat, after the command's ")")."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def stop_at(home: Path) -> None:
    """Stop the server of the node home `home`, if it has one (its VMs are gone)."""
    stop_server(home / STATE_DIR, home / MOUNT_DIR)


def stop_server(state: Path, mountpoint: Path) -> None:
    """Unmount and end the server of `state` (only when no VM reads its files any more).

    Killing it loses nothing: what it wrote is checked again before anything serves it.
    """
    if _mounted(mountpoint):
        _unmount(mountpoint)
    pid = server_pid(state)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    (state / PID_FILE).unlink(missing_ok=True)


def _unmount(mountpoint: Path) -> None:
    """Detach the mount now (lazily: a process still reading keeps its files until it is done)."""
    subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, check=False)


# ---- the server process --------------------------------------------------------------------------


def watch_node(node: int, mountpoint: Path) -> None:
    """Unmount and end this process when the node process `node` (its parent) ends (blocking)."""
    try:
        pidfd = os.pidfd_open(node)
    except ProcessLookupError:
        pidfd = None
    if pidfd is not None and os.getppid() == node:  # else the node ended before it was watched
        select.select([pidfd], [], [])
    log.info("node process %d ended: unmounting %s", node, mountpoint)
    _unmount(mountpoint)
    os._exit(0)


def serve(state: Path, mountpoint: Path, cache_root: Path, reader: BlobReader) -> None:
    """Mount the filesystem and serve it until unmounted or signalled (the process's main)."""
    import mfusepy  # only the server needs libfuse

    class LazyFS(mfusepy.Operations):
        """Read-only: one file per published blob, named by its hex digest."""

        use_ns = True

        def __init__(self) -> None:
            self._files: dict[str, ChunkFile] = {}
            self._lock = threading.Lock()

        def _file(self, path: str) -> ChunkFile:
            name = path.lstrip("/")
            with self._lock:
                if name in self._files:
                    return self._files[name]
            try:
                index = ChunkIndex.from_json((state / "index" / f"{name}.json").read_bytes())
            except (OSError, ValueError):
                raise mfusepy.FuseOSError(errno.ENOENT) from None

            def fetch(offset: int, length: int) -> bytes:
                return reader.read_range(f"sha256:{name}", offset, length)

            with self._lock:
                return self._files.setdefault(name, ChunkFile(cache_root / name, index, fetch))

        def getattr(self, path: str, fh: object = None) -> dict[str, int]:
            if path == "/":
                return {"st_mode": stat.S_IFDIR | 0o555, "st_nlink": 2}
            return {"st_mode": stat.S_IFREG | 0o444, "st_nlink": 1, "st_size": self._file(path).index.size}

        def readdir(self, path: str, fh: object) -> list[str]:
            return [".", "..", *(p.stem for p in (state / "index").glob("*.json"))]

        def open(self, path: str, fi: object) -> int:
            self._file(path)
            if fi.flags & os.O_ACCMODE != os.O_RDONLY:  # type: ignore[attr-defined]
                raise mfusepy.FuseOSError(errno.EROFS)
            fi.keep_cache = 1  # type: ignore[attr-defined]  # the page cache outlives each open
            return 0

        def read(self, path: str, size: int, offset: int, fh: object) -> bytes:
            try:
                return self._file(path).read(offset, size)
            except mfusepy.FuseOSError:
                raise
            except Exception:
                log.exception("read of %d bytes at %d of %s failed", size, offset, path)
                raise mfusepy.FuseOSError(errno.EIO) from None

    mfusepy.FUSE(
        LazyFS(), str(mountpoint), foreground=True, ro=True, raw_fi=True, allow_other=True,
        fsname="aenv-lazyfs", attr_timeout=FOREVER, entry_timeout=FOREVER,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    parser.add_argument("state", type=Path)
    parser.add_argument("mountpoint", type=Path)
    parser.add_argument("cache_root", type=Path)
    parser.add_argument("--node", type=int, required=True, help="the node process this server ends with")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=logs.TEXT_FORMAT)
    location = S3Location(**json.loads(os.environ.pop(LOCATION_ENV)))
    threading.Thread(target=watch_node, args=(args.node, args.mountpoint), daemon=True).start()
    serve(args.state, args.mountpoint, args.cache_root, BlobReader(location))


if __name__ == "__main__":
    main()
