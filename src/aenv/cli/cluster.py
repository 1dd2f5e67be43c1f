"""`aenv scheduler` and `aenv gateway` (run the cluster's scheduler, a gateway) and
`aenv node ls|drain` (ask the scheduler about nodes).

The node commands talk to the scheduler at `--scheduler-url`, else `AENV_SCHEDULER_URL`, with
the cluster secret of `AENV_CLUSTER_SECRET` (or the TOML file of `AENV_CONFIG_PATH`).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ..config import ConfigError, load_settings
from . import output
from .common import output_flag, server_part
from .config import CLIError

if TYPE_CHECKING:
    from ..cluster.client import SchedulerClient

T = TypeVar("T")

COLUMNS: list[output.Column] = [
    ("NODE ID", lambda n: n["node_id"]),
    ("STATUS", lambda n: n["status"]),
    ("ADDRESS", lambda n: n["address"]),
    ("RUNNING", lambda n: n["usage"]["running"]),
    ("PAUSED", lambda n: n["usage"]["paused"]),
    ("MEM USED/CAP (MiB)", lambda n: f"{n['usage']['memory_mib']}/{n['capacity']['memory_mib']}"),
    ("VCPUS", lambda n: f"{n['usage']['vcpus']}/{n['capacity']['vcpus']}"),
    ("VERSION", lambda n: n["version"]),
    ("HEARTBEAT", lambda n: f"{max(0.0, time.time() - n['heartbeat_at']):.0f}s ago"),
]


def register(commands: argparse._SubParsersAction) -> None:
    scheduler = commands.add_parser(
        "scheduler", help="run the cluster's scheduler: node registry, placement, bindings (AENV_* settings)"
    )
    scheduler.set_defaults(run=run_scheduler)
    gateway = commands.add_parser(
        "gateway", help="run a gateway: the cluster's E2B API and sandbox proxy (AENV_* settings)"
    )
    gateway.set_defaults(run=run_gateway)
    parser = commands.add_parser(
        "node",
        parents=[scheduler_flag(None)],
        help="list the cluster's nodes, drain one (asks the scheduler)",
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="<action>")
    flags = [output_flag(), scheduler_flag(argparse.SUPPRESS)]
    listing = actions.add_parser("list", aliases=["ls"], parents=flags, help="list nodes")
    listing.set_defaults(run=run_list)
    drain = actions.add_parser(
        "drain", parents=flags, help="take no new sandboxes on a node; its sandboxes stay"
    )
    drain.add_argument("node_id")
    drain.set_defaults(run=run_drain)


def scheduler_flag(default: object) -> argparse.ArgumentParser:
    """`--scheduler-url`, before or after the action (SUPPRESS there keeps the value given before)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--scheduler-url", default=default, help="the scheduler (default: AENV_SCHEDULER_URL)"
    )
    return parent


def run_scheduler(args: argparse.Namespace) -> int:
    server_part(".cluster.scheduler").main()
    return 0


def run_gateway(args: argparse.Namespace) -> int:
    server_part(".cluster.gateway").main()
    return 0


def _ask(args: argparse.Namespace, call: Callable[[SchedulerClient], Awaitable[T]]) -> T:
    """One call to the scheduler, its failure as one sentence."""
    try:
        settings = load_settings()
    except ConfigError as exc:
        raise CLIError(str(exc)) from None
    url = args.scheduler_url or settings.scheduler_url
    if not url:
        raise CLIError("no scheduler: set AENV_SCHEDULER_URL or pass --scheduler-url")
    client_module = server_part(".cluster.client")
    errors = server_part(".orchestrator.errors")

    async def ask() -> T:
        client = client_module.SchedulerClient(url, settings.cluster_secret)
        try:
            return await call(client)
        finally:
            await client.close()

    try:
        return asyncio.run(ask())
    except errors.SandboxError as exc:
        raise CLIError(exc.message) from None


def run_list(args: argparse.Namespace) -> int:
    nodes: list[dict[str, Any]] = [n.model_dump(mode="json") for n in _ask(args, lambda c: c.nodes())]
    output.emit(nodes, args.output, COLUMNS, "No nodes.")
    return 0


def run_drain(args: argparse.Namespace) -> int:
    node = _ask(args, lambda c: c.drain(args.node_id)).model_dump(mode="json")
    output.done(node, f"Draining node {args.node_id}: it takes no new sandboxes", args.output)
    return 0
