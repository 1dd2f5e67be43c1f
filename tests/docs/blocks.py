"""The code blocks of README.md and docs/deploy.md, read from the files at run time.

A block that a test runs is marked by an HTML comment on the line before its fence, invisible
when the page is rendered:

    <!-- docs-test: NAME -->
    ```sh

The test takes the block's text as it is in the file and may only make the explicit
substitutions it lists (ports, homes, key files, input for an interactive shell): each is a
literal that must occur in the block, so a block that changes under a recipe fails loudly
instead of silently running something else. Every other block must be listed in `NOT_RUN`
with the reason it is not run and what checks it instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = ("README.md", "docs/deploy.md")

_FENCE = re.compile(
    r"(?:<!-- docs-test: (?P<name>[a-z0-9-]+) -->\n)?```(?P<lang>\w*)\n(?P<text>.*?)^```$", re.S | re.M
)


@dataclass(frozen=True)
class Block:
    document: str
    name: str | None  # the docs-test marker's name; None when unmarked
    lang: str
    text: str

    @property
    def first_line(self) -> str:
        return self.text.splitlines()[0]


def blocks(document: str) -> list[Block]:
    text = (REPO / document).read_text()
    return [Block(document, m["name"], m["lang"], m["text"]) for m in _FENCE.finditer(text)]


def marked(name: str) -> Block:
    found = [b for document in DOCUMENTS for b in blocks(document) if b.name == name]
    assert len(found) == 1, f"expected one block marked `docs-test: {name}`, found {len(found)}"
    return found[0]


def substitute(block: Block, replacements: list[tuple[str, str]]) -> str:
    """The block's text with each literal replaced (every occurrence); each must be present."""
    text = block.text
    for old, new in replacements:
        assert old in text, f"{block.document} `{block.name}` no longer contains {old!r}: update its test"
        text = text.replace(old, new)
    return text


# Blocks no test runs, by document and the start of their first line: why, and what covers them.
NOT_RUN: dict[tuple[str, str], str] = {
    (
        "README.md",
        "make run     # installs what a node needs",
    ): "serves forever on :8000 with /var/lib/aenv: the docs tests run its equivalent (aenv.devnode, "
    "`aenv server` on a seeded temporary home); `make test` is what CI runs",
    (
        "README.md",
        "from e2b import Sandbox, Template, wait_for_port",
    ): "builds from docker.io, which is not reachable here: tests/template builds with the same SDK "
    "calls from a local registry",
    (
        "README.md",
        "aenv template build ./ctx --name my-app:v1",
    ): "needs a Dockerfile whose image a registry serves: tests/e2e/test_template_build.py runs "
    "`aenv template build` on a context of its own",
    (
        "README.md",
        "deploy/install.sh --enable scheduler,gateway,server",
    ): "starts systemd units (no systemd here): tests/deploy/test_install.py runs install.sh into a "
    "temporary root and checks the units with systemd-analyze; the cluster itself is docs/deploy.md's "
    "`cluster-one-machine` block",
    ("docs/deploy.md", "make run      # Debian 12/13 as root"): "the README's `make run`, see there",
    (
        "docs/deploy.md",
        "sudo deploy/install.sh --enable scheduler,gateway,server",
    ): "systemd units: tests/deploy/test_install.py (into a temporary root)",
    (
        "docs/deploy.md",
        "podman build -f deploy/image/Containerfile -t localhost/aenv:latest .",
    ): "image builds need podman and a registry: deploy/image/build.sh is the check (docs/deploy.md)",
    (
        "docs/deploy.md",
        "deploy/image/build.sh\n",
    ): "image builds and Compose need podman: tests/deploy/test_compose.py checks the file offline",
    (
        "README.md",
        "from e2b import Sandbox\nfrom aenv import rollouts",
    ): "run as pasted by tests/e2e/test_rollouts.py (test_the_readme_examples_work_pasted), on the "
    "e2e session's node",
    (
        "README.md",
        "aenv fanout base -n 2",
    ): "run as pasted by tests/e2e/test_rollouts.py (test_the_readme_examples_work_pasted)",
    (
        "README.md",
        "export AENV_FUSION_TOKEN=",
    ): "starts `make run` on :8000 in the background: tests/fusion/test_fusion.py makes the same "
    "`sandbox-fusion` client calls against a node started with a token",
    (
        "README.md",
        "import asyncio\n\nfrom e2b import AsyncSandbox",
    ): "256 sandboxes need a cluster: tests/cluster/test_sdk_load.py makes the same SDK calls, 256 at "
    "once, through a gateway over two nodes",
    (
        "README.md",
        "pip install 'harbor[e2b]'",
    ): "needs Python 3.12 and Harbor from PyPI: tests/e2e/test_harbor.py runs the same `harbor run` "
    "from a trixie tree against a node and a gateway",
    (
        "docs/deploy.md",
        "deploy/compose/secrets.sh > deploy/k8s/secrets.env",
    ): "needs a Kubernetes cluster: tests/deploy/test_k8s.py validates the manifests offline",
}
