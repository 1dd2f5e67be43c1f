"""`aenv completion bash|zsh`: a completion script generated from the parser itself, so it never drifts.

Commands, subcommands, flags and flag choices are static; sandbox IDs and template names are fetched
when completing (`aenv _complete sandboxes|templates`, with a one-second budget).
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import httpx

from . import config
from .api import Api

DYNAMIC = {
    "sandbox_id": "sandboxes", "sandbox_ids": "sandboxes",
    "target": "templates", "template": "templates", "templates": "templates", "snapshots": "templates",
}  # fmt: skip


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("completion", help="print a shell completion script (bash or zsh)")
    parser.add_argument("shell", choices=("bash", "zsh"))
    parser.set_defaults(run=run)
    hidden = commands.add_parser("_complete")  # no help: left out of `aenv --help`
    hidden.add_argument("kind", choices=("sandboxes", "templates"))
    hidden.set_defaults(run=run_candidates)


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


Table = dict[str, tuple[list[str], str]]


def _walk(parser: argparse.ArgumentParser, path: str, table: Table, choices: dict[str, str]) -> None:
    """Fill `table`: command path -> (completion words, dynamic kind) and `choices`: flag -> values."""
    words: list[str] = []
    dynamic = ""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if name.startswith("_"):
                    continue
                words.append(name)
                _walk(sub, f"{path} {name}".strip(), table, choices)
        elif action.option_strings:
            options = action.option_strings
            words += [o for o in options if o.startswith("--") or len(options) == 1]
            if action.choices:
                for option in action.option_strings:
                    choices[option] = " ".join(map(str, action.choices))
        elif action.dest in DYNAMIC:
            dynamic = DYNAMIC[action.dest]
        elif action.choices:
            words += [str(c) for c in action.choices]
    table[path] = (words, dynamic)


def bash_script(parser: argparse.ArgumentParser) -> str:
    table: Table = {}
    choices: dict[str, str] = {}
    _walk(parser, "", table, choices)
    paths = "|".join(f'"{p}"' for p in table if p)
    cases = "\n".join(f'    "{p}") words="{" ".join(w)}"; dynamic="{d}" ;;' for p, (w, d) in table.items())
    flags = "\n".join(
        f'    {o}) COMPREPLY=($(compgen -W "{v}" -- "$cur")); return ;;' for o, v in choices.items()
    )
    return f"""# aenv completion for bash (bash 3.2+); `source <(aenv completion bash)`
_aenv() {{
  local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="${{COMP_WORDS[COMP_CWORD-1]}}" path="" w i
  case "$prev" in
{flags}
  esac
  for ((i = 1; i < COMP_CWORD; i++)); do
    w="${{COMP_WORDS[i]}}"
    case "$path${{path:+ }}$w" in
      {paths}) path="$path${{path:+ }}$w" ;;
    esac
  done
  local words="" dynamic=""
  case "$path" in
{cases}
  esac
  if [[ "$cur" != -* && -n "$dynamic" ]]; then
    words="$words $(aenv _complete "$dynamic" 2>/dev/null)"
  fi
  COMPREPLY=($(compgen -W "$words" -- "$cur"))
}}
complete -o default -F _aenv aenv
"""


def run(args: argparse.Namespace) -> int:
    script = bash_script(args.parser)  # the whole command's (`build_parser` passes itself)
    if args.shell == "zsh":
        script = (
            "# aenv completion for zsh; `source <(aenv completion zsh)`\n"
            "autoload -U +X compinit && compinit\nautoload -U +X bashcompinit && bashcompinit\n" + script
        )
    sys.stdout.write(script)
    return 0


def run_candidates(args: argparse.Namespace) -> int:
    """Best effort and fast: a slow or absent server completes nothing rather than hanging the shell."""
    with contextlib.suppress(Exception):
        client = Api(config.load(), timeout=httpx.Timeout(1.0, connect=0.5))
        if args.kind == "sandboxes":
            names = [s["sandboxID"] for s in client.call("GET", "/v2/sandboxes")]
        else:
            found = client.call("GET", "/v2/templates") + client.call("GET", "/snapshots")
            names = [n for item in found for n in item.get("names") or []]
        print(" ".join(names))
    return 0
