"""`aenv auth`: ask for the server URL and API key, check them against the server, store them 0600."""

from __future__ import annotations

import argparse
import getpass
import sys

from . import config
from .api import Api
from .config import CLIError, Credentials


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "auth", help="log in to a server: store its URL and API key",
        description="Prompts for the server URL and API key (or takes --url/--api-key), verifies them "
        "and stores them in ~/.config/aenv/credentials (mode 0600).",
    )  # fmt: skip
    parser.add_argument("--url", help="server URL (skips the prompt)")
    parser.add_argument("--api-key", help="API key (skips the prompt; beware of shell history)")
    parser.add_argument("--no-verify", action="store_true", help="store without asking the server")
    parser.set_defaults(run=run)


def _ask(prompt: str, *, secret: bool) -> str:
    """Prompts on the terminal; plain lines from stdin when piped (scripts, tests)."""
    if sys.stdin.isatty():
        return getpass.getpass(prompt) if secret else input(prompt)
    print(prompt, end="", file=sys.stderr, flush=True)
    return sys.stdin.readline().strip()


def run(args: argparse.Namespace) -> int:
    stored = config.read_file()
    default_url = stored.get("url") or config.DEFAULT_URL
    url = args.url or _ask(f"AENV server URL [{default_url}]: ", secret=False).strip() or default_url
    key = args.api_key or _ask("API key: ", secret=True).strip()
    if not key:
        raise CLIError("an API key is required (the server prints where it stored one at start-up)")
    credentials = Credentials(config.normalize_url(url), key)
    if not args.no_verify:
        Api(credentials).call("GET", "/v2/sandboxes", params={"limit": "1"})
    path = config.save(credentials)
    print(f"Authenticated to {credentials.url}; credentials saved to {path}", file=sys.stderr)
    return 0
