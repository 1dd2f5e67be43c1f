"""JSON shapes the SDKs parse: every required key present, states only `running` or `paused`."""

from __future__ import annotations

import platform
from typing import Any

from ..orchestrator.interface import NodeStatus
from ..orchestrator.launch import DISK_SIZE_MB
from ..orchestrator.states import State, api_state
from ..orchestrator.store import SandboxRecord
from ..repository.manifest import SnapshotManifest
from ..snapshot.pending import PENDING_MARK

CLIENT_ID = "aenv"


def sandbox(record: SandboxRecord, domain: str) -> dict[str, Any]:
    """`Sandbox`: what create, connect and fork return."""
    return {
        "templateID": record.template_id,
        "sandboxID": record.sandbox_id,
        "alias": record.alias,
        "clientID": CLIENT_ID,
        "envdVersion": record.envd_version,
        "envdAccessToken": record.envd_token,
        "trafficAccessToken": record.traffic_token,
        "domain": domain,
    }


def listed(record: SandboxRecord) -> dict[str, Any]:
    """`ListedSandbox`; a paused sandbox's end time is when it was paused, as E2B reports it."""
    paused = record.state == State.PAUSED and record.paused_at
    return {
        "templateID": record.template_id,
        "alias": record.alias,
        "sandboxID": record.sandbox_id,
        "clientID": CLIENT_ID,
        "startedAt": record.started_at,
        "endAt": record.paused_at if paused else record.end_at,
        "cpuCount": record.cpu_count,
        "memoryMB": record.memory_mb,
        "diskSizeMB": record.disk_size_mb,
        "metadata": record.metadata,
        "state": api_state(record.state),
        "envdVersion": record.envd_version,
        "volumeMounts": [dict(m) for m in record.volume_mounts],
        "envdUnresponsiveAtPause": False,
    }


def detail(record: SandboxRecord, domain: str) -> dict[str, Any]:
    """`SandboxDetail` = `ListedSandbox` plus tokens, network and lifecycle."""
    body = listed(record) | {
        "envdAccessToken": record.envd_token,
        "allowInternetAccess": record.allow_internet,
        "domain": domain,
        "network": record.network,
        "lifecycle": {
            "autoResume": record.auto_resume,
            "onTimeout": "pause" if record.auto_pause else "kill",
        },
    }
    if api_state(record.state) == "paused":
        body["pauseMode"] = "full"
        # aenv's: whether the pause is committed to the shared repository yet (then another node
        # can take it over); false while it is on this node only, and always with a local repository.
        body["durable"] = record.durable
    return body


def _names(manifest: SnapshotManifest) -> list[str]:
    return [manifest.alias] if manifest.alias else [manifest.id]


def snapshot_info(manifest: SnapshotManifest) -> dict[str, Any]:
    return {
        "snapshotID": manifest.id,
        "names": _names(manifest),
        "cpuCount": manifest.machine.vcpus,
        "memoryMB": manifest.machine.memory_mib,
        "diskSizeMB": DISK_SIZE_MB,
        "createdAt": manifest.created_at,
        "updatedAt": manifest.created_at,
        # aenv's: committed to the repository (false: captured on the node, being committed;
        # only this node knows it meanwhile, and a create from it there waits for the commit).
        "durable": PENDING_MARK not in manifest.metadata,
        # aenv's: its lineage, the sandbox it was taken of, the template or snapshot that sandbox
        # started from and its checkpoint (if any) the state came from.
        "source": {
            "sandboxID": manifest.source.get("sandbox_id"),
            "snapshotID": manifest.source.get("snapshot_id"),
            "checkpointID": manifest.source.get("checkpoint_id"),
        },
    }


def template(manifest: SnapshotManifest, envd_version: str) -> dict[str, Any]:
    return {
        "templateID": manifest.id,
        "buildID": manifest.id,
        "cpuCount": manifest.machine.vcpus,
        "memoryMB": manifest.machine.memory_mib,
        "diskSizeMB": DISK_SIZE_MB,
        "public": False,
        "names": _names(manifest),
        "aliases": [manifest.alias] if manifest.alias else [],
        "createdAt": manifest.created_at,
        "updatedAt": manifest.created_at,
        "createdBy": None,
        "lastSpawnedAt": None,
        "spawnCount": 0,
        "buildCount": 1,
        "envdVersion": envd_version,
        "buildStatus": "ready",
    }


def template_with_builds(manifest: SnapshotManifest, envd_version: str) -> dict[str, Any]:
    build = {
        "buildID": manifest.id,
        "status": "ready",
        "createdAt": manifest.created_at,
        "updatedAt": manifest.created_at,
        "finishedAt": manifest.created_at,
        "cpuCount": manifest.machine.vcpus,
        "memoryMB": manifest.machine.memory_mib,
        "diskSizeMB": DISK_SIZE_MB,
        "envdVersion": envd_version,
    }
    summary = template(manifest, envd_version)
    keys = ("templateID", "public", "names", "aliases", "createdAt", "updatedAt", "lastSpawnedAt")
    keys += ("spawnCount",)
    return {key: summary[key] for key in keys} | {"builds": [build]}


def node(status: NodeStatus, version: str) -> dict[str, Any]:
    """A node as AgentENV's `/nodes` reports it: identity, machine, counts and allocations."""
    records = status.records
    running = [r for r in records if api_state(r.state) == "running"]
    paused = [r for r in records if api_state(r.state) == "paused"]
    return {
        "version": version,
        "commit": "",
        "id": status.node_id,
        "serviceInstanceID": status.node_id,
        "clusterID": "",
        "machineInfo": {
            "cpuFamily": "",
            "cpuModel": "",
            "cpuModelName": platform.processor() or platform.machine(),
            "cpuArchitecture": platform.machine(),
        },
        "status": "ready",
        "sandboxCount": len(running),
        "metrics": {
            "allocatedCPU": sum(r.cpu_count for r in running),
            "allocatedMemoryBytes": sum(r.memory_mb for r in running) << 20,
            "pausedAllocatedCPU": sum(r.cpu_count for r in paused),
            "pausedAllocatedMemoryBytes": sum(r.memory_mb for r in paused) << 20,
        },
        "createSuccesses": status.create_successes,
        "createFails": status.create_failures,
        "sandboxStartingCount": sum(1 for r in records if r.state == State.CREATING),
        "sandboxPausedCount": len(paused),
    }
