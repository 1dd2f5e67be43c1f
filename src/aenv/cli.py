"""The `aenv` command."""

from __future__ import annotations

import argparse
import sys

from . import __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aenv", description="Agent environments as microVMs.")
    parser.add_argument("--version", action="version", version=f"aenv {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("server", help="run the node: API, proxy and VMs (AENV_* settings)")
    args = parser.parse_args(argv)
    if args.command == "server":
        from .node import main as serve

        serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
