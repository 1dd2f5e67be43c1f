"""Build the ``code-interpreter-v1`` template (the ``e2b-code-interpreter`` SDK's default) with
the official E2B SDK against a node: ``.venv/bin/python templates/code-interpreter/template.py``
(``E2B_API_URL``, ``E2B_API_KEY`` point at the node, as for any SDK call).

The Dockerfile beside this file is the template; this adds matplotlib (charts come back as PNG
results) unless ``--lean``, and replaces the Dockerfile ``CMD``'s fixed 20 s ready wait (E2B's
rule for Dockerfiles) with a check that the service answers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from e2b import Template, wait_for_url
from e2b.template.main import TemplateBuilder

HERE = Path(__file__).resolve().parent
NAME = "code-interpreter-v1"
START_CMD = "python3 /opt/aenv-interpreter/serve.py"
READY_URL = "http://127.0.0.1:49999/health"
CHART_PACKAGES = "matplotlib"


def template(*, charts: bool = True, pip_options: str = "") -> TemplateBuilder:
    """The template definition; ``charts`` adds matplotlib (a few minutes of pip under TCG),
    installed with ``pip_options`` (e.g. ``--index-url`` of a mirror)."""
    builder = Template(file_context_path=str(HERE)).from_dockerfile(str(HERE / "Dockerfile"))
    if charts:
        # Debian's python3 is externally managed: system-wide packages need the override.
        command = ["pip install --no-cache-dir --break-system-packages", pip_options, CHART_PACKAGES]
        builder = builder.run_cmd(" ".join(part for part in command if part), user="root")
    return builder.set_start_cmd(START_CMD, wait_for_url(READY_URL))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default=NAME, help=f"NAME[:TAG] of the template (default {NAME})")
    parser.add_argument("--lean", action="store_true", help="without matplotlib")
    parser.add_argument("--pip-options", default="", help="more options of the pip install, e.g. a mirror")
    args = parser.parse_args()
    definition = template(charts=not args.lean, pip_options=args.pip_options)
    info = Template.build(definition, args.name, on_build_logs=lambda entry: print(entry.message))
    print(f"built {info.template_id} (build {info.build_id})")


if __name__ == "__main__":
    main()
