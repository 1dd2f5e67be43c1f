"""`aenv template list|get|delete`: the templates sandboxes start from."""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import quote

from . import output
from .common import api, output_flag

COLUMNS: list[output.Column] = [
    ("NAME", lambda t: (t.get("names") or t.get("aliases") or ["-"])[0]),
    ("TEMPLATE ID", lambda t: t.get("templateID")),
    ("STATUS", lambda t: t.get("buildStatus")),
    ("CPU", lambda t: t.get("cpuCount")),
    ("MEM (MiB)", lambda t: t.get("memoryMB")),
    ("DISK (MiB)", lambda t: t.get("diskSizeMB")),
    ("UPDATED", lambda t: output.when(t.get("updatedAt"))),
]


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("template", aliases=["templates"], help="list, inspect and delete templates")
    actions = parser.add_subparsers(dest="action", required=True, metavar="<action>")
    listing = actions.add_parser("list", aliases=["ls"], parents=[output_flag()], help="list templates")
    listing.set_defaults(run=run_list)
    get = actions.add_parser("get", aliases=["show"], parents=[output_flag()], help="show one template")
    get.add_argument("template", help="template ID or name")
    get.set_defaults(run=run_get)
    delete = actions.add_parser(
        "delete", aliases=["rm"], parents=[output_flag()], help="delete templates or snapshots"
    )
    delete.add_argument("templates", nargs="+", metavar="template", help="template or snapshot ID or name")
    delete.set_defaults(run=run_delete)


def run_list(args: argparse.Namespace) -> int:
    templates = list(api().pages("/v2/templates"))
    output.emit(templates, args.output, COLUMNS, "No templates.")
    return 0


def run_get(args: argparse.Namespace) -> int:
    template: dict[str, Any] = api().template(args.template)
    output.details(template, args.output)
    return 0


def run_delete(args: argparse.Namespace) -> int:
    client = api()
    deleted = []
    for name in args.templates:
        client.call("DELETE", f"/templates/{quote(name, safe='')}")
        deleted.append({"templateID": name, "deleted": True})
    output.done(deleted, "\n".join(f"Deleted {name}" for name in args.templates), args.output)
    return 0
