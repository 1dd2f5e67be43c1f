"""Node settings: defaults, then a TOML file (`AENV_CONFIG_PATH`), then `AENV_*` environment variables.

Every setting has one environment variable, its name upper-cased with the `AENV_` prefix
(`api_addr` → `AENV_API_ADDR`); in the TOML file settings may sit at the top level or in any
table (`[server] api_addr = ...`), so files stay readable without nesting rules to learn.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from . import paths
from .repository.location import is_s3_url

BOOLEANS = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}


class ConfigError(ValueError):
    """A setting has a value of the wrong type or out of range."""


@dataclass(frozen=True)
class Settings:
    api_addr: str = "127.0.0.1:8000"
    home_path: Path = dataclasses.field(default_factory=paths.home_dir)
    api_key: str | None = None
    domain: str = ""  # sandbox hosts are {port}-{sandboxID}.{domain}; empty: the API host's name
    accel: str = "auto"
    vcpus: int = 0  # of the base template; 0: 2 under KVM, 1 under TCG
    memory_mib: int = 512
    default_timeout: int = 300  # seconds, for creates that name none
    max_timeout: int = 24 * 3600
    max_fork_count: int = 16
    warm_pool_size: int = 2  # restored guests kept ready per template
    # A paused sandbox keeps its stopped QEMU process this long (0: not at all) for an instant
    # resume, at most park_max of them, fewer when host memory runs short (aenv.snapshot.parking).
    park_seconds: float = 300.0
    park_max: int = 128
    # A sandbox's last checkpoint (taken or reset to) kept restored in a stopped QEMU, so that a
    # reset to it continues that one (aenv.snapshot.standby); at most one per sandbox.
    reset_standby: bool = True
    shutdown_action: str = "pause"  # what SIGTERM does to running sandboxes: pause or kill
    # Seconds a stop waits for the object store (commits of pauses and snapshots, lease releases;
    # aenv.node.STOP_GRACE more for pauses held up by reads of it): what is not committed by then
    # stays on disk for the next start.
    stop_timeout: float = 15.0
    # This node's share of the sandbox network slots (see aenv.network.slots); nodes sharing a
    # host need disjoint ranges, and a node only ever cleans up namespaces of its own range.
    slot_first: int = 0
    slot_count: int = 1024
    evict_interval: float = 1.0
    # Confinement and limits of every VMM (aenv.vmm.confine): no capabilities and a seccomp filter
    # (vmm_confine; off only to measure its cost or debug QEMU), a cgroup per VM bounding CPU to its
    # vCPUs, memory to guest RAM plus vmm_memory_overhead_mib (QEMU itself, its TCG translation
    # cache and I/O buffers) and its threads to vmm_pids_max. Every QEMU runs as a uid of its own
    # (and the group of that number), from vmm_uid_base + 2 * slot_first on, 2 * slot_count of
    # them (nodes with disjoint slot ranges get disjoint uids); the range must hold no host user
    # (checked at start). 0: QEMU stays uid 0, without capabilities.
    vmm_confine: bool = True
    vmm_uid_base: int = 2_000_000_000
    vmm_cgroups: bool = True
    vmm_memory_overhead_mib: int = 192
    vmm_pids_max: int = 256
    # The CPU weight of all VMs together against the node's 100 (cgroup v2 cpu.weight, 1..10000;
    # aenv.vmm.confine.CgroupTree.weigh), when they and the node want more CPU than the host has.
    # Each VM stays bounded to its vCPUs and VMs share equally among themselves, whatever it is.
    # 100, the kernel's default, stays: at 10 the node's API waited a third as long for a CPU at
    # 64 rollouts (p99 49 -> 12 ms, bench `rollout`, 2 cores), but on cgroup v1 every process of
    # the root group weighs 1024 shares against the VMs' whole group, so a few busy host processes
    # (an SDK client, a gateway, a second node) starved every guest: 256 SDK sandboxes through a
    # gateway over two nodes had guests miss their 30 s `/init` and commands their 240 s bound.
    vmm_cpu_weight: int = 100
    # Volumes (aenv.volumes): each is a filesystem image of its size, volume_max_mib when a create
    # names none (and the most one may name). Their servers map guests' uids and gids 0..65535
    # onto the host's volume_uid_base.. (a range that must hold no host user).
    volume_max_mib: int = 1024
    volume_uid_base: int = 1_900_000_000
    # Merge equal pages across this node's QEMUs (KSM, aenv.vmm.merge): about 14 MiB less host RAM
    # per idle sandbox under TCG, for ksmd's CPU, QEMU without layout randomisation and the side
    # channels of shared pages; for single-tenant fleets. Needs KSM running on the host.
    memory_merge: bool = False
    # Admission control (aenv.orchestrator.admission): the guest RAM of running sandboxes may add
    # up to this multiple of the host's RAM (clones share their template's memory image: the
    # density target is 12x); creates, resumes, pauses and snapshots are refused while the
    # home's filesystem has less than disk_reserve_mib free.
    memory_overcommit: float = 16.0
    disk_reserve_mib: int = 2048
    # Freed guest memory goes back to the host (aenv.orchestrator.reclaim): every reclaim_interval
    # seconds (0: never) for resting sandboxes whose VMM's private memory grew by
    # reclaim_growth_mib or that ran since their last scan, and for all that grew, idlest first,
    # while the host has less than reclaim_pressure_mib available. A start
    # needs what running VMs hold per MiB of guest RAM, times its own, plus memory_reserve_mib.
    reclaim_interval: float = 2.0
    reclaim_growth_mib: int = 16
    reclaim_pressure_mib: int = 2048
    memory_reserve_mib: int = 256
    # Under TCG, each QEMU's translation buffer in MiB (aenv.vmm.machine): host RAM a guest that
    # ran code keeps besides its RAM (32: 28 MiB less per diverged sandbox, its commands ~1.4x slower).
    tcg_translation_cache_mib: int = 64
    # Each sandbox's serial console is kept as a ring of about this many MiB (aenv.vmm.serial).
    serial_log_mib: int = 8
    gc_interval: float = 600.0  # seconds between garbage collections (0: only at start)
    # Where committed snapshots live (aenv.runtime.open): a directory (posix_fs; empty means
    # <home>/repository) or s3://BUCKET/PREFIX on an S3-compatible store, which then needs the
    # region; credentials come from s3_access_key/s3_secret_key or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY.
    repository: str = ""
    s3_endpoint: str = ""  # e.g. http://127.0.0.1:8333; empty: AWS's own endpoint for the region
    s3_region: str = ""
    s3_access_key: str | None = None
    s3_secret_key: str | None = None
    cache_capacity_mib: int = 20480  # the runtime cache of an s3 repository (files QEMU opens)
    lazy_loading: bool = True  # an s3 repository's memory images load on demand (aenv.runtime.lazyfs)
    # Peer-to-peer blob transport (aenv.runtime.peers), off by default: a node with an s3
    # repository serves the blobs it holds whole to peers and asks peers before the store (every
    # blob is verified against its digest). Peers: the nodes the scheduler lists (in a cluster),
    # else p2p_peers, comma-separated base URLs (http://host:port).
    p2p: bool = False
    p2p_peers: str = ""
    lease_ttl: float = 600.0  # a node silent this long is dead to the others: its leases expire
    # A snapshot another node answered but has not committed yet: waited for this many seconds
    # before a 503 `snapshot_pending` (aenv.snapshot.pending).
    pending_wait: float = 30.0
    template_builds: int = 2  # user template builds running at once, each in its own VM
    # The cluster (aenv.cluster): a node joins when scheduler_url is set and advertises node_addr
    # (a base URL; empty: http://<api_addr>). cluster_secret is what nodes, gateways and the
    # scheduler present to each other; a node in a cluster takes control calls only with it.
    scheduler_url: str = ""
    node_addr: str = ""
    cluster_secret: str | None = None
    scheduler_addr: str = "127.0.0.1:9090"  # where `aenv scheduler` listens
    gateway_addr: str = "127.0.0.1:8080"  # where `aenv gateway` listens
    redis_url: str = "redis://127.0.0.1:6379/0"  # the scheduler's shared state
    heartbeat_interval: float = 2.0  # seconds between a node's heartbeats
    node_down_after: float = 10.0  # a node silent this long is down
    # How long the scheduler remembers a sandbox killed while its node was down (its tombstone):
    # the node, back within this time, kills it instead of binding it again.
    tombstone_ttl: float = 30 * 86400.0
    # SandboxFusion's API (aenv.api.fusion) at <node or gateway URL>/fusion/<fusion_token>; off
    # while unset. Each request runs in a fresh sandbox of fusion_template.
    fusion_token: str | None = None
    fusion_template: str = "base"
    log_level: str = "INFO"
    log_format: str = "text"  # or json: one object a line, with the sandbox's id (aenv.logs)

    @property
    def host(self) -> str:
        return self.api_addr.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.api_addr.rsplit(":", 1)[1])

    @property
    def peer_urls(self) -> list[str]:
        """`p2p_peers` as base URLs without a trailing slash."""
        return [peer.strip().rstrip("/") for peer in self.p2p_peers.split(",") if peer.strip()]

    def validate(self) -> Settings:
        problems = []
        if ":" not in self.api_addr or not self.api_addr.rsplit(":", 1)[1].isdigit():
            problems.append(f"api_addr must be host:port, got {self.api_addr!r}")
        if self.shutdown_action not in ("pause", "kill"):
            problems.append(f"shutdown_action must be pause or kill, got {self.shutdown_action!r}")
        if self.log_format not in ("text", "json"):
            problems.append(f"log_format must be text or json, got {self.log_format!r}")
        if self.accel not in ("auto", "kvm", "tcg"):
            problems.append(f"accel must be auto, kvm or tcg, got {self.accel!r}")
        if is_s3_url(self.repository):
            if not self.repository[5:].split("/", 1)[0]:
                problems.append(f"repository must be s3://BUCKET/PREFIX, got {self.repository!r}")
            if not self.s3_region:
                problems.append("an s3 repository needs its region: set AENV_S3_REGION")
        elif "://" in self.repository:
            problems.append(f"repository must be a directory or s3://BUCKET/PREFIX, got {self.repository!r}")
        if any(not peer.startswith(("http://", "https://")) for peer in self.peer_urls):
            problems.append(f"p2p_peers must be comma-separated http(s) base URLs, got {self.p2p_peers!r}")
        positive = ("memory_mib", "default_timeout", "max_timeout", "max_fork_count", "cache_capacity_mib")
        for name in (*positive, "template_builds", "serial_log_mib"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be positive")
        if self.vcpus < 0:
            problems.append("vcpus must not be negative")
        if self.slot_first < 0 or self.slot_count < 1:
            problems.append("slot_first must not be negative and slot_count must be positive")
        first_uid = self.vmm_uid_base + 2 * self.slot_first
        if self.vmm_uid_base and not (first_uid >= 65536 and first_uid + 2 * self.slot_count <= 2**31):
            problems.append("vmm_uid_base must be 0, or leave the VMM uids between 65536 and 2**31 - 1")
        if self.volume_max_mib < 16 or not 65536 <= self.volume_uid_base <= 2**31 - 1 - 65536:
            problems.append("volume_max_mib must be at least 16, volume_uid_base in 65536..2**31 - 65537")
        if self.vmm_memory_overhead_mib < 0 or self.vmm_pids_max < 16 or self.memory_overcommit <= 0:
            problems.append("vmm_memory_overhead_mib, vmm_pids_max (>= 16) or memory_overcommit out of range")
        if not 1 <= self.vmm_cpu_weight <= 10000:
            problems.append("vmm_cpu_weight must be in 1..10000")
        for name in ("warm_pool_size", "park_seconds", "park_max", "gc_interval", "disk_reserve_mib"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must not be negative")
        if self.tcg_translation_cache_mib < 1:
            problems.append("tcg_translation_cache_mib must be at least 1")
        if min(self.reclaim_interval, self.reclaim_growth_mib, self.reclaim_pressure_mib) < 0:
            problems.append("reclaim_interval, reclaim_growth_mib and reclaim_pressure_mib must be >= 0")
        if self.stop_timeout < 0 or self.pending_wait < 0:
            problems.append("stop_timeout and pending_wait must not be negative")
        if self.lease_ttl <= 0 or self.tombstone_ttl <= 0:
            problems.append("lease_ttl and tombstone_ttl must be positive")
        if problems:
            raise ConfigError("; ".join(problems))
        return self


def _coerce(name: str, kind: Any, value: Any) -> Any:
    kind = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    try:
        if "Path" in kind:
            return Path(value)
        if kind.startswith("bool"):
            return value if isinstance(value, bool) else BOOLEANS[str(value).lower()]
        if kind.startswith("int"):
            return int(value)
        if kind.startswith("float"):
            return float(value)
        return None if value is None else str(value)
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"setting {name}: {value!r} is not a valid {kind}") from exc


def load_settings(environ: dict[str, str] | None = None) -> Settings:
    """Settings from the defaults, the TOML file named by AENV_CONFIG_PATH, and the environment."""
    environ = dict(os.environ if environ is None else environ)
    known = {f.name: f.type for f in fields(Settings)}
    values: dict[str, Any] = {}
    config_path = environ.get("AENV_CONFIG_PATH")
    if config_path:
        try:
            document = tomllib.loads(Path(config_path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config {config_path}: {exc}") from exc
        flat = {k: v for k, v in document.items() if not isinstance(v, dict)}
        for table in (v for v in document.values() if isinstance(v, dict)):
            flat.update(table)
        unknown = sorted(set(flat) - set(known))
        if unknown:
            raise ConfigError(f"unknown settings in {config_path}: {', '.join(unknown)}")
        values.update({k: _coerce(k, known[k], v) for k, v in flat.items()})
    for name, kind in known.items():
        variable = f"AENV_{name.upper()}"
        if variable in environ:
            values[name] = _coerce(name, kind, environ[variable])
    return Settings(**values).validate()
