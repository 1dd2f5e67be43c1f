"""`aenv server`: one process serving the API and the sandbox proxy on this node.

Start-up builds what is missing (guest artifacts, the `base` template), restores the node's
state (paused sandboxes stay paused; VMs a crash left running are adopted and paused), fills
the warm pools and listens. SIGTERM or SIGINT pause the running sandboxes (or kill them, by
configuration) before the process exits, so nothing is lost. The stop waits for the object
store only `stop_timeout` seconds: a pause or snapshot not committed by then stays on this
node's disk and is committed at its next start, and the process exits without waiting for the
store calls still in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry

from . import __version__, logs, paths
from .api import schemas
from .api.fusion import Fusion
from .api.runner import BACKLOG, APIRunner
from .api.server import NodeAPI
from .cluster.membership import Membership
from .cluster.peers import SchedulerPeers
from .config import Settings, load_settings
from .events import EventBus, SandboxStopped
from .guest.artifacts import GuestArtifacts, ensure_guest_artifacts
from .network.pool import NetworkPool
from .network.slots import SlotAllocator, SlotRangeBusy, SlotRangeLock
from .orchestrator.handover import pause_metadata
from .orchestrator.housekeeping import Housekeeper
from .orchestrator.local import LocalNode
from .orchestrator.mounting import stored_users
from .orchestrator.service import Orchestrator
from .orchestrator.store import SandboxStore
from .repository.contract import Repository
from .repository.errors import AliasConflict, SnapshotNotFound
from .runtime.open import Heartbeat, Storage, open_storage
from .runtime.peers import BlobServer, Peers
from .snapshot.engine import SnapshotEngine
from .snapshot.parking import ParkingPolicy
from .telemetry import Telemetry
from .vmm import confine, machine, merge, serial
from .vmm.accel import choose_accelerator
from .vmm.mountview import MountView
from .volumes.mounts import SandboxVolumes
from .volumes.server import VolumeServers
from .volumes.store import GUEST_IDS, IdRange, VolumeStore

log = logging.getLogger("aenv.node")

BASE_TEMPLATE = "base"
IO_THREADS = 64
STOP_GRACE = 5.0  # seconds past the stop deadline for pauses that wait on the store through a VM's reads
# What QEMU reads under the home besides layers and the repository: VM directories (streams),
# warm VMs, the s3 runtime cache.
# Not `sandboxes`: a sandbox's files (memory deltas, device state, logs) are the node's alone.
VMM_READABLE = ("runtime", "cache")


def api_key(settings: Settings) -> str:
    """The node's API key: from the settings, else the stored one, else a new one stored 0600."""
    if settings.api_key:
        return settings.api_key
    path = settings.home_path / "secrets" / "api-key"
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = "e2b_" + secrets.token_hex(32)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    os.replace(tmp, path)
    log.warning("generated an API key and stored it in %s (mode 0600)", path)
    return key


def _cluster_peers(settings: Settings, node: str) -> Peers | None:
    """In a cluster, the peers a node asks for blobs (with P2P on) are the scheduler's other nodes."""
    return (
        SchedulerPeers(settings.scheduler_url, node, settings.cluster_secret)
        if settings.scheduler_url
        else None
    )


def node_id(home: Path) -> str:
    path = home / "node-id"
    if not path.exists():
        path.write_text(secrets.token_hex(8) + "\n")
    return path.read_text().strip()


class Node:
    """Everything one node runs, started and stopped in the right order."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.runner: web.AppRunner | None = None
        self.networks: NetworkPool | None = None
        self.engine: SnapshotEngine | None = None
        self.orchestrator: Orchestrator | None = None
        self.housekeeper: Housekeeper | None = None
        self.api: NodeAPI | None = None
        self.slot_lock = SlotRangeLock(settings.slot_first, settings.slot_count)
        self.storage: Storage | None = None
        self.heartbeat: Heartbeat | None = None  # the storage's: it stops with the node
        self.mount_view: MountView | None = None
        self.membership: Membership | None = None

    async def start(self) -> None:
        settings = self.settings
        started = time.monotonic()
        # First: starting cleans up the namespaces and uplinks of this range, which another live
        # node on the host with the same slots would lose.
        self.slot_lock.acquire()
        home = settings.home_path
        home.mkdir(parents=True, exist_ok=True)
        choice = choose_accelerator(settings.accel)
        log.info("aenv %s, accelerator %s (%s), home %s", __version__, choice.accel, choice.reason, home)
        key = api_key(settings)
        artifacts = await asyncio.to_thread(ensure_guest_artifacts)
        # Storage first: its on-demand loading mounts under the home, inside the VMMs' root.
        peers = _cluster_peers(settings, node_id(home))
        self.storage = storage = open_storage(settings, node_id(home), peers)
        self.heartbeat = storage.heartbeat
        repository = storage.repository
        self._confine_vmms(home, artifacts, repository.local_root)
        if settings.memory_merge:
            merge.enable()
        repository.cleanup_staging(older_than=0)
        # Idle networks for a whole fork: making one on demand costs ~0.1 s of netlink and nft work.
        self.networks = NetworkPool(
            size=max(2, settings.warm_pool_size, settings.max_fork_count),
            prefix=f"aenv-s{settings.slot_first}-",
            slots=SlotAllocator(settings.slot_first, settings.slot_count),
        )
        parking = ParkingPolicy(max_seconds=settings.park_seconds, max_count=settings.park_max)
        store = SandboxStore(home / "node.db")
        events = EventBus()
        engine = SnapshotEngine(
            home, repository, artifacts, choice.accel, networks=self.networks, parking=parking,
            runtime=storage.runtime, durable_pauses=repository.shared, events=events,
            describe=pause_metadata(store), warm_size=settings.warm_pool_size,
            reset_standby=settings.reset_standby,
        )  # fmt: skip
        self.engine = engine
        if leftovers := engine.cleanup_warm_leftovers():
            log.warning("ended %d warm VMs left by a node process that did not stop cleanly", leftovers)
        ids = IdRange(settings.volume_uid_base, GUEST_IDS)
        volume_store = VolumeStore(home / "volumes", ids, settings.volume_max_mib, stored_users(store))
        volumes = SandboxVolumes(volume_store, VolumeServers(home / "runtime" / "volume-root", ids))
        self.orchestrator = Orchestrator(settings, engine, store, volumes)
        kept = await self.networks.start(keep=self.orchestrator.surviving_networks())
        await self.orchestrator.start(kept)
        if pending := engine.recover_pending():
            log.info("committing %d snapshots a previous node process answered but did not commit", pending)
        template = await self._base_template(engine, repository, settings)
        # After recovery and the base template: collection must know every layer they use.
        self.housekeeper = Housekeeper(engine, settings.gc_interval)
        await self.housekeeper.start()
        for manifest in repository.list("template"):
            await engine.keep_warm(manifest.id)
        registry = CollectorRegistry()
        telemetry = Telemetry(registry)
        service = LocalNode(self.orchestrator, self.housekeeper, node_id(home), telemetry.observe)
        self.api = NodeAPI(
            service, domain=self._domain(), limits=schemas.limits(settings), volumes=volume_store,
            telemetry=telemetry,
        )  # fmt: skip
        proxy = self.api.proxy
        events.subscribe(SandboxStopped, lambda stopped: proxy.release(stopped.sandbox_id))
        registry.register(self.orchestrator.reclaimer)
        # auto_decompress=False: the proxy forwards bodies as sent (a gzip upload to envd stays
        # gzip, matching its Content-Encoding and Content-Length); the API takes no compressed bodies.
        # Peers fetch whole blobs from this node's cache (404 with P2P off): aenv.runtime.peers.
        blobs = BlobServer(storage.cache if settings.p2p else None)
        if storage.peers is not None:
            registry.register(storage.peers)
            registry.register(blobs)
        self.runner = APIRunner(
            self.api.app(
                key,
                settings.cluster_secret,
                [blobs.route()],
                Fusion.of(settings, settings.api_addr, settings.cluster_secret),
            ),
            access_log=None,
            handle_signals=False,
            auto_decompress=False,
        )
        await self.runner.setup()
        await web.TCPSite(
            self.runner, settings.host, settings.port, reuse_address=True, backlog=BACKLOG
        ).start()
        log.info(
            "listening on http://%s (template %s = %s, %d sandboxes restored) after %.1f s; "
            "E2B SDK: E2B_API_URL=E2B_SANDBOX_URL=http://%s E2B_API_KEY=<key>",
            settings.api_addr, BASE_TEMPLATE, template, len(self.orchestrator.sandboxes),
            time.monotonic() - started, settings.api_addr,
        )  # fmt: skip
        if settings.scheduler_url:  # in a cluster: join it once the node serves
            self.membership = Membership.for_node(
                settings, self.orchestrator, repository, node_id(home), events
            )
            await self.membership.start()

    def _confine_vmms(self, home: Path, artifacts: GuestArtifacts, repository: Path) -> None:
        """Every QEMU from now on: unprivileged, confined, limited, in a root holding only the
        files VMs use (aenv.vmm.confine, aenv.vmm.mountview)."""
        settings = self.settings
        identities = None
        if settings.vmm_confine:
            writable = [paths.layers_dir(home), repository]  # top layers; templates' memory files
            readable = [home / name for name in VMM_READABLE]
            for directory in (*writable, *readable):
                directory.mkdir(parents=True, exist_ok=True)
            os.chmod(paths.layers_dir(home), confine.UNLISTED)
            boot = (artifacts.kernel, artifacts.initramfs, artifacts.base_image, artifacts.tools_image)
            readable += [paths.cache_dir(), *{file.parent for file in boot}]
            self.mount_view = MountView.start(writable, [d for d in readable if d.is_dir()])
            if settings.vmm_uid_base:
                first, count = settings.vmm_uid_base + 2 * settings.slot_first, 2 * settings.slot_count
                identities = confine.VmmIdentities(first, count)
                identities.check_unused()
        confinement = confine.from_settings(
            confine=settings.vmm_confine,
            cgroups=settings.vmm_cgroups,
            memory_overhead_mib=settings.vmm_memory_overhead_mib,
            pids=settings.vmm_pids_max,
            cpu_weight=settings.vmm_cpu_weight,
            mount_namespace=self.mount_view.namespace if self.mount_view else None,
            identities=identities,
        )
        confine.install(confinement)
        serial.set_capacity(settings.serial_log_mib)
        machine.set_translation_cache(settings.tcg_translation_cache_mib)

    def _domain(self) -> str:
        """Sandbox hosts are `{port}-{id}.{domain}`; by default `*.localhost` on the API's port."""
        return self.settings.domain or f"localhost:{self.settings.port}"

    async def _base_template(self, engine: SnapshotEngine, repository: Repository, settings: Settings) -> str:
        """The `base` template: built at the first start, and again when this node cannot run it."""
        try:
            manifest = repository.get(BASE_TEMPLATE)
        except SnapshotNotFound:
            log.info("building the %s template (one boot, once per node)", BASE_TEMPLATE)
        else:
            problem = await engine.incompatibility(manifest)
            if problem is None:
                return manifest.id
            log.warning("the %s template cannot run here (%s): building it again", BASE_TEMPLATE, problem)
            repository.delete(manifest.id, defer=True)
        try:
            manifest = await engine.build_template(
                BASE_TEMPLATE, vcpus=settings.vcpus or None, memory_mib=settings.memory_mib
            )
        except AliasConflict:
            # Another node of the same shared repository built it meanwhile (two fresh nodes
            # started together): its build is as good as ours, which the repository withdrew.
            manifest = repository.get(BASE_TEMPLATE)
            if problem := await engine.incompatibility(manifest):
                message = f"the {BASE_TEMPLATE} template another node built cannot run here: {problem}"
                raise RuntimeError(message) from None
            log.info("another node built the %s template meanwhile: using it", BASE_TEMPLATE)
        return manifest.id

    async def _close_orchestrator(self, orchestrator: Orchestrator) -> bool:
        """Pause (or kill) the sandboxes within the stop's bound; whether that was given up.

        A VM reading a disk block loaded on demand that the store does not serve cannot stop
        (QEMU drains its pending reads first), and the FUSE server retries the store for minutes:
        `STOP_GRACE` after the deadline the server goes, so those reads fail (the guest sees an
        I/O error) and the pauses finish. A stop still not done `STOP_GRACE` later is given up.
        """
        closing = asyncio.ensure_future(orchestrator.close())
        done, _ = await asyncio.wait({closing}, timeout=self.settings.stop_timeout + STOP_GRACE)
        lazy = self.storage.lazy if self.storage is not None else None
        if not done and lazy is not None:
            log.warning("sandboxes still stopping past the stop deadline: ending on-demand loading")
            await asyncio.to_thread(lazy.stop)
            done, _ = await asyncio.wait({closing}, timeout=STOP_GRACE)
        if done:
            closing.result()
            return False
        log.error("sandboxes still stopping: exiting; those not paused are adopted at the next start")
        return True

    async def stop(self) -> int:
        """Stop everything; returns how many store operations were given up (still running)."""
        if self.engine is not None:
            self.engine.stop_within(self.settings.stop_timeout)
        if self.runner is not None:
            await self.runner.cleanup()
        if self.housekeeper is not None:
            await self.housekeeper.close()
        given_up = self.orchestrator is not None and await self._close_orchestrator(self.orchestrator)
        if self.membership is not None:  # after the orchestrator: its sandboxes are paused now
            await self.membership.close()
        if self.networks is not None:
            await self.networks.close()
        if self.mount_view is not None:
            self.mount_view.close()
        self.slot_lock.release()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        log.info("node stopped")
        return (self.engine.abandoned if self.engine is not None else 0) + given_up


async def serve(settings: Settings) -> None:
    node = Node(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Calls to envd and page captures wait in threads, mostly on guests; with the default pool
    # (cores + 4 threads) fifty concurrent resumes would queue behind six of them.
    loop.set_default_executor(ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="aenv-io"))
    pid = os.getpid()

    def request_stop(signum: int, frame: object) -> None:
        # Not loop.add_signal_handler: children that pyroute2 forks inherit its wake-up socket,
        # and their exit signals would stop this node. A forked child ignores this handler.
        if os.getpid() == pid:
            loop.call_soon_threadsafe(stop.set)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, request_stop)
    try:
        await node.start()
        await stop.wait()
        log.info("stopping: %s running sandboxes", settings.shutdown_action)
    finally:
        if abandoned := await node.stop():
            # Their threads would hold the interpreter's exit (asyncio.run joins the executor)
            # for as long as the store takes to fail; what they did not do, the next start does.
            log.warning("exiting without %d store operations still in flight", abandoned)
            logging.shutdown()
            os._exit(0)


def main() -> None:
    settings = load_settings()
    logs.configure(settings.log_level, settings.log_format)
    logging.getLogger("qemu.qmp").setLevel(logging.WARNING)
    with contextlib.suppress(KeyboardInterrupt):
        try:
            asyncio.run(serve(settings))
        except (SlotRangeBusy, merge.MergeError) as exc:
            log.error("not starting: %s", exc)
            raise SystemExit(1) from None
