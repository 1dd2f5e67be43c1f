"""Pieces the command groups share: the `--output` flag, `K=V` arguments, the API client."""

from __future__ import annotations

import argparse

from . import config
from .api import Api


def output_flag() -> argparse.ArgumentParser:
    """`--output` accepted after the subcommand too; SUPPRESS keeps the global value otherwise."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "-o", "--output", choices=("table", "json"), default=argparse.SUPPRESS,
        help="output format (default: table on a terminal, JSON when piped)",
    )  # fmt: skip
    return parent


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
