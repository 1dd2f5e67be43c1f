"""How much each mode measures: `smoke` proves the harness works, `quick` fits in a few minutes on a
2-core TCG host, `full` is the run the targets are written for."""

from __future__ import annotations

from dataclasses import dataclass

from .targets import FIGURES

# `rollout`'s parts (`bench.rollouts`): N rollouts at once, the fan-out, reset and reuse.
ROLLOUT_PARTS = ("concurrent", "fanout", "reset")


@dataclass(frozen=True)
class Plan:
    figures: tuple[str, ...]  # measured when `--only` names none
    floor_samples: int
    create: int
    pause_resume: int  # rounds of pause then resume on one sandbox
    released: int  # rounds of pause, the node releasing the parked process, then resume
    dirty_mib: int  # memory the guest changes before its pauses
    snapshot: int
    snapshot_write_mib: int  # written to the guest's disk (with fsync) before each snapshot
    fork: int
    fork_count: int
    concurrent: int  # sandboxes resumed at once
    loaded_idle: int  # idle sandboxes on the node while create and resume are measured again
    loaded: int  # create and resume samples, on the empty node and then with the idle ones
    proxy_rtt: int  # commands.run("true") calls per path
    throughput_mib: int
    throughput_rounds: int  # downloads per path, alternating direct and proxied
    density: int
    density_idle_s: float
    soak: int  # create → exec → pause → resume → kill cycles
    template_build: int  # rounds of empty, cold and cached template builds
    cluster_create: int  # creates through the gateway, as many directly on the node
    cluster_sandboxes: int  # on the light nodes: created for the placement figure, then listed
    cluster_list: int  # walks over all pages, through the gateway and directly
    fusion: int  # rounds of 32 /run_code requests at once, alternating with as many commands.run
    rollout_counts: tuple[int, ...]  # concurrent rollouts (bench.rollouts), after one alone
    rollout_rounds: int  # rollouts each concurrent worker runs, one after the other
    rollout_fan_out: int  # sandboxes of the fan-out figure
    rollout_resets: int  # samples of reset, parked resume, and reuse against create-and-kill
    rollout_parts: tuple[str, ...] = ROLLOUT_PARTS  # the parts of `rollout` measured
    scale_full: bool = False  # cluster-scale at the full size (`bench.scale.FULL`), not the smoke size
    divergence: int = 4  # sandboxes that allocate, touch and free memory (bench.divergence)
    divergence_idle_s: float = 5.0  # idle before the fresh and after the diverged measurement
    reclaim_off: int = 2  # create and resume samples per node, reclaimer on and off (bench.reclaimoff)


MODES: dict[str, Plan] = {
    "smoke": Plan(
        figures=("create", "pause", "resume", "proxy-rtt"),
        floor_samples=2, create=2, pause_resume=2, released=1, dirty_mib=64, snapshot=1,
        snapshot_write_mib=64, fork=1, fork_count=4, concurrent=4, loaded_idle=2, loaded=2, proxy_rtt=5,
        throughput_mib=16, throughput_rounds=1, density=4, density_idle_s=2, soak=3, template_build=1,
        cluster_create=2, cluster_sandboxes=60, cluster_list=2, fusion=1, rollout_counts=(4,),
        rollout_rounds=1, rollout_fan_out=8, rollout_resets=2,
    ),
    "quick": Plan(
        figures=FIGURES,
        floor_samples=5, create=5, pause_resume=5, released=3, dirty_mib=64, snapshot=2,
        snapshot_write_mib=1024, fork=1, fork_count=16, concurrent=16, loaded_idle=16, loaded=5,
        proxy_rtt=30, throughput_mib=256, throughput_rounds=2, density=24, density_idle_s=10, soak=10,
        template_build=1, cluster_create=10, cluster_sandboxes=1000, cluster_list=5, fusion=3,
        rollout_counts=(16, 64), rollout_rounds=1, rollout_fan_out=100, rollout_resets=5,
        divergence=16, divergence_idle_s=30, reclaim_off=10,
    ),
    "full": Plan(
        figures=FIGURES,
        floor_samples=20, create=20, pause_resume=20, released=10, dirty_mib=64, snapshot=5,
        snapshot_write_mib=1024, fork=3, fork_count=16, concurrent=50, loaded_idle=200, loaded=10,
        proxy_rtt=100, throughput_mib=1024, throughput_rounds=3, density=500, density_idle_s=60, soak=1000,
        template_build=3, cluster_create=20, cluster_sandboxes=1000, cluster_list=10, fusion=10,
        rollout_counts=(16, 64, 256), rollout_rounds=2, rollout_fan_out=100, rollout_resets=20,
        divergence=200, divergence_idle_s=30, reclaim_off=20,
    ),
}  # fmt: skip
