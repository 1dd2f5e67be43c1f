"""The `aenv` command: run a node (`aenv server`) or drive one over HTTP (everything else)."""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from . import auth, cluster, completion, execute, files, rollouts, sandboxes, server, snapshots, templates
from .config import CLIError

GROUPS = (server, cluster, auth, templates, sandboxes, execute, snapshots, rollouts, files, completion)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aenv",
        description="Agent environments as microVMs: start, pause, resume, snapshot and fork sandboxes.",
        epilog="Server and key come from AENV_URL/AENV_API_KEY, else from `aenv auth`.",
    )
    parser.add_argument("--version", action="version", version=f"aenv {__version__}")
    parser.add_argument(
        "-o", "--output", choices=("table", "json"), default=None,
        help="output format (default: table on a terminal, JSON when piped)",
    )  # fmt: skip
    commands = parser.add_subparsers(dest="command", required=True, metavar="<command>")
    for group in GROUPS:
        group.register(commands)
    parser.set_defaults(parser=parser)  # `aenv completion` describes the whole command
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except CLIError as exc:
        print(f"aenv: error: {exc.message}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        sys.stderr.close()  # `aenv ls | head`: the reader left, nothing more to say
        return 141


if __name__ == "__main__":
    sys.exit(main())
