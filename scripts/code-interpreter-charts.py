"""Build the full ``code-interpreter-v1`` template (with matplotlib) and draw a chart in it.

    python scripts/code-interpreter-charts.py [--seed HOME]

Too slow for the test suite under TCG (pip installs matplotlib and numpy inside the build VM,
which needs the node's egress to reach PyPI), so it is a script: it starts a throwaway node
(``aenv.devnode``; ``--seed`` takes the ``base`` template of an existing node home instead of
building it) unless ``E2B_API_URL`` and ``E2B_API_KEY`` name one, builds the template with
``templates/code-interpreter/template.py``, runs a matplotlib cell through the official
``e2b-code-interpreter`` SDK, checks that a PNG came back, and prints the build times (cold,
then cached). Run it under ``flock /tmp/aenv-vm.lock`` on a host shared with the test suite.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import importlib.util
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SLOT_FIRST = 14336  # apart from the tests' nodes and the benchmark's
CHART = """
import matplotlib.pyplot as plt
plt.plot([1, 2, 3], [1, 4, 9])
plt.title("squares")
plt.show()
"""


@contextlib.contextmanager
def node(seed: Path | None) -> Iterator[None]:
    """E2B_* pointing at a node: the caller's, or a throwaway one."""
    if os.environ.get("E2B_API_URL") and os.environ.get("E2B_API_KEY"):
        yield
        return
    from aenv.devnode import DevNode

    with (
        tempfile.TemporaryDirectory(prefix="aenv-charts-") as tmp,
        DevNode(Path(tmp) / "home", slot_first=SLOT_FIRST, seed=seed) as dev,
    ):
        os.environ.update(E2B_API_URL=dev.url, E2B_SANDBOX_URL=dev.url, E2B_API_KEY=dev.key)
        yield


def build(definition: Any, name: str, pip_options: str) -> float:
    from e2b import Template

    started = time.monotonic()
    template = definition.template(charts=True, pip_options=pip_options)
    Template.build(template, name, on_build_logs=lambda e: print(" ", e.message))
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=Path, help="a node home holding the base template")
    parser.add_argument(
        "--pip-options", default="",
        help="more options of the pip install: a mirror, --trusted-host behind a TLS-intercepting proxy",
    )  # fmt: skip
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("template", ROOT / "templates/code-interpreter/template.py")
    assert spec is not None and spec.loader is not None
    definition = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(definition)
    with node(args.seed):
        from e2b_code_interpreter import Sandbox

        cold = build(definition, definition.NAME, args.pip_options)
        cached = build(definition, definition.NAME, args.pip_options)
        sandbox = Sandbox.create()
        try:
            execution = sandbox.run_code(CHART)
        finally:
            sandbox.kill()
    pngs = [base64.b64decode(r.png) for r in execution.results if r.png]
    if execution.error or not pngs or not pngs[0].startswith(b"\x89PNG"):
        raise SystemExit(f"no chart came back: {execution}")
    print(f"chart: {len(pngs[0])} bytes of PNG")
    print(f"build with matplotlib: {cold:.0f} s cold, {cached:.0f} s cached")


if __name__ == "__main__":
    main()
