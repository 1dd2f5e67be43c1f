"""Node-level benchmark: sandbox lifecycle and data-plane figures of a real aenv node, against targets.

    python -m bench [--mode smoke|quick|full] [--only NAME[,NAME]] [--json PATH] [--profile NAME]
                    [--seed HOME] [--memory-merge] [--memory-pressed] [--rollout-counts N[,N]]
                    [--divergence N] [--rollout-parts concurrent,fanout,reset]

Starts its own node (`aenv server` on a temporary home, removed afterwards; its first start
builds the `base` template, or takes the one of the node home given by --seed) unless AENV_URL
names one (with AENV_API_KEY); floors and host figures need the node's host and are n/a then. Each row:
median, p95, p99, min, max, n, the target, the floor measured in the same run, the ratio to it,
and whether the target is met. Times are wall clock from the client's request to the node's
answer, which for create, resume and fork comes only after the guest's envd answered `/init`.
With --memory-merge the node merges equal pages across its QEMUs (bench/merging.py); with
--memory-pressed its reclaimer acts as under host pressure throughout (bench/divergence.py).
"""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from .node import REPO
from .plan import MODES, ROLLOUT_PARTS
from .profile import FORMATS
from .run import Options, run
from .targets import FIGURES


def _names(value: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown figure {', '.join(unknown)}; known: {', '.join(FIGURES)}")
    return names


def _counts(value: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(n) for n in value.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"not a list of positive counts: {value!r}")
    return counts


def _parts(value: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in value.split(",") if p.strip())
    if not parts or set(parts) - set(ROLLOUT_PARTS):
        raise argparse.ArgumentTypeError(f"not a list of {', '.join(ROLLOUT_PARTS)}: {value!r}")
    return parts


def _terminate(pid: int) -> Callable[[int, FrameType | None], None]:
    """SIGTERM ends the run as Ctrl-C does (figures clean up, the node is stopped). Processes that
    pyroute2 forks inherit the handler; they end as SIGTERM's default action would end them."""

    def handler(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        raise KeyboardInterrupt

    return handler


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=sorted(MODES), default="quick")
    parser.add_argument("--only", type=_names, default=(), metavar="NAME[,NAME]", help=", ".join(FIGURES))
    parser.add_argument("--json", type=Path, help="result file (default: bench/results/<mode>.json)")
    parser.add_argument(
        "--profile", choices=FIGURES, metavar="NAME", help="py-spy the node during this figure"
    )
    parser.add_argument("--profile-format", choices=sorted(FORMATS), default="speedscope")
    parser.add_argument(
        "--seed", type=Path, metavar="HOME", help="start the node with the `base` template of this node home"
    )
    parser.add_argument("--soak-cycles", type=int, metavar="N", help="soak cycles (default: the mode's)")
    parser.add_argument(
        "--memory-merge", action="store_true",
        help="the node merges equal pages across its QEMUs (AENV_MEMORY_MERGE), with KSM on for the run",
    )  # fmt: skip
    parser.add_argument(
        "--memory-pressed", action="store_true",
        help="the node reclaims as under host pressure throughout (guests drop their clean page cache)",
    )  # fmt: skip
    parser.add_argument(
        "--scale-full", action="store_true", help="cluster-scale at 1,000 nodes and 100,000 sandboxes"
    )
    parser.add_argument(
        "--rollout-counts", type=_counts, metavar="N[,N]", help="concurrent rollouts (default: the mode's)"
    )
    parser.add_argument(
        "--rollout-parts", type=_parts, metavar="PART[,PART]", help="parts of `rollout` (default: all)"
    )
    parser.add_argument(
        "--divergence", type=lambda v: _counts(v)[0], metavar="N", help="sandboxes of `divergence`"
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _terminate(os.getpid()))
    options = Options(
        mode=args.mode,
        only=args.only,
        json_path=args.json or REPO / "bench" / "results" / f"{args.mode}.json",
        profile=args.profile,
        profile_format=args.profile_format,
        seed=args.seed,
        soak_cycles=args.soak_cycles,
        memory_merge=args.memory_merge,
        memory_pressed=args.memory_pressed,
        scale_full=args.scale_full,
        rollout_counts=args.rollout_counts,
        rollout_parts=args.rollout_parts,
        divergence=args.divergence,
    )
    try:
        return run(options)
    except KeyboardInterrupt:
        print("bench: interrupted; the node and everything it started were stopped")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
