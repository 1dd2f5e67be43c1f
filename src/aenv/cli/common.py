"""Pieces the command groups share: the `--output` flag, `K=V` arguments, the API client."""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType

from . import config
from .api import Api
from .config import CLIError


def output_flag() -> argparse.ArgumentParser:
    """`--output` accepted after the subcommand too; SUPPRESS keeps the global value otherwise."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "-o", "--output", choices=("table", "json"), default=argparse.SUPPRESS,
        help="output format (default: table on a terminal, JSON when piped)",
    )  # fmt: skip
    return parent


def server_part(name: str) -> ModuleType:
    """Import a module of the server side (`aenv server`, `scheduler`, `gateway`, `node`).

    Imported when such a command runs, never at start: a client-only install (`pip install aenv`,
    without the `server` extra) has none of their dependencies, and the other commands need none.
    """
    try:
        return importlib.import_module(name, "aenv")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "aenv":
            raise
        raise CLIError(
            f"this command needs the server's dependencies ({exc.name} is missing): "
            "pip install 'aenv[server]'"
        ) from None


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def api() -> Api:
    return Api(config.load())
