"""Sandbox lifecycle: start, connect, list, pause, resume, timeout, delete, fork and the serial log."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any
from urllib.parse import quote

from ..vmm.serial import NEXT_START_HEADER
from . import output, terminal
from .api import Api
from .common import api, key_value, output_flag, positive
from .config import CLIError
from .envd import Envd, EnvdError

DEFAULT_TIMEOUT = 300
READY_WITHIN_S = 30.0
LOG_PAGE = 1000

COLUMNS: list[output.Column] = [
    ("SANDBOX ID", lambda s: s.get("sandboxID")),
    ("TEMPLATE", lambda s: s.get("alias") or s.get("templateID")),
    ("STATE", lambda s: s.get("state")),
    ("CPU", lambda s: s.get("cpuCount")),
    ("MEM (MiB)", lambda s: s.get("memoryMB")),
    ("STARTED", lambda s: output.when(s.get("startedAt"))),
    ("ENDS", lambda s: output.when(s.get("endAt")) if s.get("state") == "running" else "-"),
    ("METADATA", lambda s: s.get("metadata")),
]
FORK_COLUMNS: list[output.Column] = [
    ("SANDBOX ID", lambda s: s.get("sandboxID")),
    ("TEMPLATE", lambda s: s.get("alias") or s.get("templateID")),
]


def _path(sandbox_id: str, action: str = "") -> str:
    return f"/sandboxes/{quote(sandbox_id, safe='')}" + (f"/{action}" if action else "")


def _shell_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-u", "--user", help="Linux user of the shell (default: the template's, `user`)")
    parser.add_argument("-w", "--cwd", help="working directory of the shell")


def register(commands: argparse._SubParsersAction) -> None:
    start = commands.add_parser(
        "start", aliases=["run"], parents=[output_flag()],
        help="start a sandbox from a template or snapshot and open a shell in it",
    )  # fmt: skip
    start.add_argument("target", metavar="template|snapshot", help="template or snapshot ID or name")
    start.add_argument("-d", "--detach", action="store_true", help="print the sandbox ID instead of a shell")
    start.add_argument(
        "--timeout", type=positive, default=DEFAULT_TIMEOUT,
        help=f"seconds until the sandbox is stopped (default {DEFAULT_TIMEOUT})",
    )  # fmt: skip
    start.add_argument("--cpu", "--cpus", "--cpu-count", dest="cpus", type=positive, help="vCPUs (see below)")
    start.add_argument(
        "--memory", "--memory-mb", "--mem", dest="memory", type=positive,
        help="memory in MiB; resources come from the snapshot, so these only confirm what it has",
    )  # fmt: skip
    start.add_argument("-e", "--env", action="append", type=key_value, default=[], metavar="K=V")
    start.add_argument("-m", "--metadata", action="append", type=key_value, default=[], metavar="K=V")
    start.add_argument("--secure", action="store_true", help="require the envd access token (as E2B v2)")
    start.add_argument("--auto-pause", action="store_true", help="pause instead of kill at the timeout")
    start.add_argument("--rm", action="store_true", help="delete the sandbox when the shell exits")
    _shell_flags(start)
    start.set_defaults(run=run_start)

    connect = commands.add_parser("connect", aliases=["cn"], help="open a shell in a sandbox, resuming it")
    connect.add_argument("sandbox_id")
    connect.add_argument("--timeout", type=positive, help="extend the sandbox's TTL to at least this")
    _shell_flags(connect)
    connect.set_defaults(run=run_connect)

    listing = commands.add_parser(
        "list", aliases=["ls", "ps"], parents=[output_flag()], help="list sandboxes"
    )
    listing.add_argument(
        "-s", "--state", action="append", default=[], choices=("running", "paused"),
        help="only sandboxes in this state (repeatable)",
    )  # fmt: skip
    listing.add_argument(
        "-m", "--metadata", action="append", type=key_value, default=[], metavar="K=V",
        help="only sandboxes with this metadata (repeatable; all must match)",
    )  # fmt: skip
    listing.add_argument("-q", "--quiet", action="store_true", help="print only the IDs")
    listing.set_defaults(run=run_list)

    info = commands.add_parser("info", aliases=["inspect"], parents=[output_flag()], help="show a sandbox")
    info.add_argument("sandbox_id")
    info.set_defaults(run=run_info)

    pause = commands.add_parser("pause", parents=[output_flag()], help="pause sandboxes (memory kept)")
    pause.add_argument("sandbox_ids", nargs="+", metavar="sandbox_id")
    pause.set_defaults(run=run_pause)

    resume = commands.add_parser("resume", parents=[output_flag()], help="resume paused sandboxes")
    resume.add_argument("sandbox_ids", nargs="+", metavar="sandbox_id")
    resume.add_argument("--timeout", type=positive, default=DEFAULT_TIMEOUT, help="TTL after resuming")
    resume.set_defaults(run=run_resume)

    timeout = commands.add_parser("timeout", parents=[output_flag()], help="set a sandbox's remaining TTL")
    timeout.add_argument("sandbox_id")
    timeout.add_argument("seconds", type=positive)
    timeout.set_defaults(run=run_timeout)

    delete = commands.add_parser(
        "delete", aliases=["rm", "kill"], parents=[output_flag()], help="delete sandboxes"
    )
    delete.add_argument("sandbox_ids", nargs="+", metavar="sandbox_id")
    delete.set_defaults(run=run_delete)

    fork = commands.add_parser("fork", parents=[output_flag()], help="clone a running sandbox N times")
    fork.add_argument("sandbox_id")
    fork.add_argument("-n", "--count", type=positive, default=1, help="number of copies (default 1)")
    fork.add_argument("--timeout", type=positive, help="TTL of the copies (default: the source's)")
    fork.set_defaults(run=run_fork)

    logs = commands.add_parser("logs", parents=[output_flag()], help="a sandbox's serial console")
    logs.add_argument("sandbox_id")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    logs.add_argument("-n", "--tail", type=positive, help="only the last N lines")
    logs.set_defaults(run=run_logs)


# -- shells ----------------------------------------------------------------------------------


async def _wait_ready(client: Api, sandbox: dict[str, Any]) -> None:
    """envd answers a process list once the guest is up (it normally already is)."""
    envd = Envd(client.url, sandbox)
    deadline = time.monotonic() + READY_WITHIN_S
    try:
        while True:
            try:
                await envd.unary("process.Process/List", {})
                return
            except (EnvdError, CLIError):
                if time.monotonic() > deadline:
                    raise CLIError(
                        f"sandbox {sandbox['sandboxID']} envd not healthy within {READY_WITHIN_S:.0f}s"
                    ) from None
                await asyncio.sleep(0.2)
    finally:
        await envd.aclose()


def _check_resources(client: Api, args: argparse.Namespace) -> None:
    """A sandbox restores the snapshot's machine, so a different size cannot be honoured: say so."""
    if args.cpus is None and args.memory is None:
        return
    template = client.template(args.target)
    build = (template.get("builds") or [{}])[0]
    have_cpus, have_memory = build.get("cpuCount"), build.get("memoryMB")
    wrong = []
    if args.cpus is not None and args.cpus != have_cpus:
        wrong.append(f"--cpus {args.cpus}")
    if args.memory is not None and args.memory != have_memory:
        wrong.append(f"--memory {args.memory}")
    if wrong:
        raise CLIError(
            f"{' and '.join(wrong)} cannot be honoured: sandboxes restore the snapshot's machine, and "
            f"'{args.target}' has {have_cpus} vCPUs and {have_memory} MiB (snapshot a sandbox of that size)"
        )


def run_start(args: argparse.Namespace) -> int:
    client = api()
    _check_resources(client, args)
    body: dict[str, Any] = {"templateID": args.target, "timeout": args.timeout, "secure": args.secure}
    if args.env:
        body["envVars"] = dict(args.env)
    if args.metadata:
        body["metadata"] = dict(args.metadata)
    if args.auto_pause:
        body["autoPause"] = True
    sandbox = client.call("POST", "/sandboxes", json=body)
    sandbox_id = sandbox["sandboxID"]
    if args.detach:
        if args.output == "json":
            output.print_json(sandbox)
        else:
            print(sandbox_id)
        return 0
    print(f"Started sandbox {sandbox_id}", file=sys.stderr)
    try:
        asyncio.run(_wait_ready(client, sandbox))
        return asyncio.run(terminal.attach(client, sandbox, user=args.user, cwd=args.cwd))
    finally:
        if args.rm:
            client.call("DELETE", _path(sandbox_id))
            print(f"Deleted sandbox {sandbox_id}", file=sys.stderr)


def run_connect(args: argparse.Namespace) -> int:
    client = api()
    sandbox = client.connect(args.sandbox_id, args.timeout)
    return asyncio.run(terminal.attach(client, sandbox, user=args.user, cwd=args.cwd))


# -- lifecycle -------------------------------------------------------------------------------


def run_list(args: argparse.Namespace) -> int:
    sandboxes = api().sandboxes(args.state, dict(args.metadata))
    if args.quiet:
        for sandbox in sandboxes:
            print(sandbox["sandboxID"])
    else:
        output.emit(sandboxes, args.output, COLUMNS, "No sandboxes.")
    return 0


def run_info(args: argparse.Namespace) -> int:
    sandbox = api().sandbox(args.sandbox_id)
    sandbox.pop("envdAccessToken", None)
    output.details(sandbox, args.output)
    return 0


def run_pause(args: argparse.Namespace) -> int:
    client = api()
    results = []
    for sandbox_id in args.sandbox_ids:
        client.call("POST", _path(sandbox_id, "pause"))
        results.append({"sandboxID": sandbox_id, "state": "paused"})
    output.done(results, "\n".join(f"Paused {r['sandboxID']}" for r in results), args.output)
    return 0


def run_resume(args: argparse.Namespace) -> int:
    client = api()
    results = [client.connect(sandbox_id, args.timeout) for sandbox_id in args.sandbox_ids]
    for result in results:
        result.pop("envdAccessToken", None)
        result.pop("trafficAccessToken", None)
    output.done(results, "\n".join(f"Resumed {r['sandboxID']}" for r in results), args.output)
    return 0


def run_timeout(args: argparse.Namespace) -> int:
    api().call("POST", _path(args.sandbox_id, "timeout"), json={"timeout": args.seconds})
    result = {"sandboxID": args.sandbox_id, "timeout": args.seconds}
    output.done(result, f"Timeout for {args.sandbox_id} set to {args.seconds}s", args.output)
    return 0


def run_delete(args: argparse.Namespace) -> int:
    client = api()
    results = []
    for sandbox_id in args.sandbox_ids:
        client.call("DELETE", _path(sandbox_id))
        results.append({"sandboxID": sandbox_id, "deleted": True})
    output.done(results, "\n".join(f"Deleted sandbox {r['sandboxID']}" for r in results), args.output)
    return 0


def run_fork(args: argparse.Namespace) -> int:
    if args.count < 1:
        raise CLIError("--count must be at least 1")
    body: dict[str, Any] = {"count": args.count}
    if args.timeout is not None:
        body["timeout"] = args.timeout
    children = [item["sandbox"] for item in api().call("POST", _path(args.sandbox_id, "fork"), json=body)]
    for child in children:
        child.pop("envdAccessToken", None)
        child.pop("trafficAccessToken", None)
    output.emit(children, args.output, FORK_COLUMNS)
    return 0


# -- serial console --------------------------------------------------------------------------


def _log_page(client: Api, sandbox_id: str, start: int) -> tuple[list[dict[str, Any]], int]:
    """A page of lines from line `start`, and the `start` of the next (the node drops its oldest
    lines, so a page can begin later than asked)."""
    params = {"start": str(start), "limit": str(LOG_PAGE)}
    response = client.request("GET", _path(sandbox_id, "logs"), params=params)
    return response.json().get("logs", []), int(response.headers.get(NEXT_START_HEADER, start))


def run_logs(args: argparse.Namespace) -> int:
    """Following is a poll for lines past the last one seen."""
    client = api()
    as_json = output.json_mode(args.output)
    entries: list[dict[str, Any]] = []
    page, start = _log_page(client, args.sandbox_id, 0)
    while page:
        entries += page
        if len(page) < LOG_PAGE:
            break
        page, start = _log_page(client, args.sandbox_id, start)
    shown = entries[-args.tail :] if args.tail else entries
    if as_json and not args.follow:
        output.print_json(shown)
        return 0

    def show(batch: list[dict[str, Any]]) -> None:
        for entry in batch:
            print(json.dumps(entry) if as_json else entry.get("line", ""), flush=True)

    show(shown)
    while args.follow:
        time.sleep(1.0)
        try:
            page, start = _log_page(client, args.sandbox_id, start)
        except CLIError as exc:
            if exc.status != 404:
                raise
            print(f"Sandbox {args.sandbox_id} is gone.", file=sys.stderr)
            return 0
        entries += page
        show(page)
    return 0
