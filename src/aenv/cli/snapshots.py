"""`aenv snapshot create|list|delete`: named, restorable copies of a running sandbox (memory included)."""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import quote

from . import output
from .common import api, output_flag

COLUMNS: list[output.Column] = [
    ("SNAPSHOT ID", lambda s: s.get("snapshotID")),
    ("NAMES", lambda s: s.get("names")),
    ("CPU", lambda s: s.get("cpuCount")),
    ("MEM (MiB)", lambda s: s.get("memoryMB")),
    ("CREATED", lambda s: output.when(s.get("createdAt"))),
]


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("snapshot", aliases=["snap"], help="create, list and delete snapshots")
    actions = parser.add_subparsers(dest="action", required=True, metavar="<action>")
    create = actions.add_parser("create", parents=[output_flag()], help="snapshot a running sandbox")
    create.add_argument("sandbox_id")
    create.add_argument("--name", help="a name to start sandboxes from (`aenv start <name>`)")
    create.set_defaults(run=run_create)
    listing = actions.add_parser("list", aliases=["ls"], parents=[output_flag()], help="list snapshots")
    listing.add_argument("--sandbox-id", help="only snapshots of this sandbox")
    listing.set_defaults(run=run_list)
    delete = actions.add_parser("delete", aliases=["rm"], parents=[output_flag()], help="delete snapshots")
    delete.add_argument("snapshots", nargs="+", metavar="snapshot", help="snapshot ID or name")
    delete.set_defaults(run=run_delete)


def run_create(args: argparse.Namespace) -> int:
    body = {"name": args.name} if args.name else {}
    path = f"/sandboxes/{quote(args.sandbox_id, safe='')}/snapshots"
    snapshot: dict[str, Any] = api().call("POST", path, json=body)
    output.done(snapshot, f"Created snapshot {snapshot['snapshotID']}", args.output)
    return 0


def run_list(args: argparse.Namespace) -> int:
    params = {"sandboxID": args.sandbox_id} if args.sandbox_id else {}
    snapshots = list(api().pages("/snapshots", params))
    output.emit(snapshots, args.output, COLUMNS, "No snapshots.")
    return 0


def run_delete(args: argparse.Namespace) -> int:
    client = api()
    for name in args.snapshots:
        # The delete route serves templates too: make sure this one is a snapshot first.
        client.call("GET", f"/snapshots/{quote(name, safe='')}")
        client.call("DELETE", f"/templates/{quote(name, safe='')}")
    results = [{"snapshotID": name, "deleted": True} for name in args.snapshots]
    output.done(results, "\n".join(f"Deleted snapshot {name}" for name in args.snapshots), args.output)
    return 0
