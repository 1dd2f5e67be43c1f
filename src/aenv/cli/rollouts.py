"""`aenv fanout`, `aenv checkpoint create|ls|rm` and `aenv reset`: rollouts at training scale."""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import quote

from . import output
from .common import api, key_value, output_flag, positive

DEFAULT_TIMEOUT = 300
FAN_OUT_COLUMNS: list[output.Column] = [
    ("SANDBOX ID", lambda r: (r.get("sandbox") or {}).get("sandboxID")),
    ("ERROR", lambda r: (r.get("error") or {}).get("message")),
]
CHECKPOINT_COLUMNS: list[output.Column] = [
    ("CHECKPOINT ID", lambda c: c.get("checkpointID")),
    ("NAME", lambda c: c.get("name")),
    ("PARENT", lambda c: c.get("parent")),
    ("PAGES", lambda c: c.get("pages")),
    ("CREATED", lambda c: output.when(c.get("createdAt"))),
]


def _checkpoints(sandbox_id: str, checkpoint: str = "") -> str:
    path = f"/sandboxes/{quote(sandbox_id, safe='')}/checkpoints"
    return f"{path}/{quote(checkpoint, safe='')}" if checkpoint else path


def register(commands: argparse._SubParsersAction) -> None:
    fan = commands.add_parser(
        "fanout", parents=[output_flag()], help="start many sandboxes from one template or snapshot at once"
    )
    fan.add_argument("target", metavar="template|snapshot", help="template or snapshot ID or name")
    fan.add_argument("-n", "--count", type=positive, required=True, help="how many (1-1000)")
    fan.add_argument("--timeout", type=positive, default=DEFAULT_TIMEOUT, help="seconds each one lives")
    fan.add_argument("-e", "--env", action="append", type=key_value, default=[], metavar="K=V")
    fan.add_argument("-m", "--metadata", action="append", type=key_value, default=[], metavar="K=V")
    fan.add_argument("--key", help="idempotency key: the same call again returns the same sandboxes")
    fan.set_defaults(run=run_fan_out)

    checkpoint = commands.add_parser(
        "checkpoint", aliases=["cp"], help="create, list and delete checkpoints of a sandbox"
    )
    actions = checkpoint.add_subparsers(dest="action", required=True, metavar="<action>")
    create = actions.add_parser("create", parents=[output_flag()], help="checkpoint a running sandbox")
    create.add_argument("sandbox_id")
    create.add_argument("--name", help="a name to reset to (`aenv reset <sandbox> <name>`)")
    create.set_defaults(run=run_create)
    listing = actions.add_parser("list", aliases=["ls"], parents=[output_flag()], help="list checkpoints")
    listing.add_argument("sandbox_id")
    listing.set_defaults(run=run_list)
    delete = actions.add_parser("delete", aliases=["rm"], parents=[output_flag()], help="delete checkpoints")
    delete.add_argument("sandbox_id")
    delete.add_argument("checkpoints", nargs="+", metavar="checkpoint", help="checkpoint ID or name")
    delete.set_defaults(run=run_delete)
    promote = actions.add_parser(
        "snapshot", parents=[output_flag()], help="make a snapshot of a checkpoint, to start sandboxes from"
    )
    promote.add_argument("sandbox_id")
    promote.add_argument("checkpoint", help="checkpoint ID or name")
    promote.add_argument("--name", help="a name to start sandboxes from (`aenv start <name>`)")
    promote.set_defaults(run=run_promote)

    reset = commands.add_parser(
        "reset", parents=[output_flag()], help="restore a running sandbox to one of its checkpoints"
    )
    reset.add_argument("sandbox_id")
    reset.add_argument("checkpoint", help="checkpoint ID or name")
    reset.set_defaults(run=run_reset)


def run_fan_out(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"templateID": args.target, "count": args.count, "timeout": args.timeout}
    if args.env:
        body["envVars"] = dict(args.env)
    if args.metadata:
        body["metadata"] = dict(args.metadata)
    if args.key:
        body["idempotencyKey"] = args.key
    results: list[dict[str, Any]] = api().call("POST", "/sandboxes/fanout", json=body)
    output.emit(results, args.output, FAN_OUT_COLUMNS)
    return 0 if all("sandbox" in r for r in results) else 1


def run_create(args: argparse.Namespace) -> int:
    body = {"name": args.name} if args.name else {}
    checkpoint: dict[str, Any] = api().call("POST", _checkpoints(args.sandbox_id), json=body)
    output.done(checkpoint, f"Created checkpoint {checkpoint['checkpointID']}", args.output)
    return 0


def run_list(args: argparse.Namespace) -> int:
    found = api().call("GET", _checkpoints(args.sandbox_id))
    output.emit(found, args.output, CHECKPOINT_COLUMNS, "No checkpoints.")
    return 0


def run_delete(args: argparse.Namespace) -> int:
    client = api()
    for name in args.checkpoints:
        client.call("DELETE", _checkpoints(args.sandbox_id, name))
    results = [{"checkpointID": name, "deleted": True} for name in args.checkpoints]
    output.done(results, "\n".join(f"Deleted checkpoint {name}" for name in args.checkpoints), args.output)
    return 0


def run_promote(args: argparse.Namespace) -> int:
    body = {"name": args.name} if args.name else {}
    path = _checkpoints(args.sandbox_id, args.checkpoint) + "/snapshot"
    snapshot: dict[str, Any] = api().call("POST", path, json=body)
    output.done(snapshot, f"Created snapshot {snapshot['snapshotID']}", args.output)
    return 0


def run_reset(args: argparse.Namespace) -> int:
    path = f"/sandboxes/{quote(args.sandbox_id, safe='')}/reset"
    sandbox = api().call("POST", path, json={"checkpoint": args.checkpoint})
    output.done(sandbox, f"Reset sandbox {sandbox['sandboxID']} to {args.checkpoint}", args.output)
    return 0
