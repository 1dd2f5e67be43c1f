"""`aenv server`: run this machine as a node (API, proxy and VMs)."""

from __future__ import annotations

import argparse

from .common import server_part


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("server", help="run the node: API, proxy and VMs (AENV_* settings)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    server_part(".node").main()
    return 0
