"""`aenv template build|list|get|delete|tag`: the templates sandboxes start from.

`build` turns a Dockerfile (ordinary single-stage ones) into E2B template steps with the
official SDK's own converter and builds it on the node through the SDK's `Template.build`, so
the CLI and SDK users get the same steps, uploads and cache; build logs stream as they come.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

from e2b import Template
from e2b.exceptions import BuildException, FileUploadException, TemplateException
from e2b.template.dockerfile_parser import DockerfileSyntaxError, parse_dockerfile

from . import config, output
from .common import api, output_flag, positive

COLUMNS: list[output.Column] = [
    ("NAME", lambda t: (t.get("names") or t.get("aliases") or ["-"])[0]),
    ("TEMPLATE ID", lambda t: t.get("templateID")),
    ("STATUS", lambda t: t.get("buildStatus")),
    ("CPU", lambda t: t.get("cpuCount")),
    ("MEM (MiB)", lambda t: t.get("memoryMB")),
    ("DISK (MiB)", lambda t: t.get("diskSizeMB")),
    ("UPDATED", lambda t: output.when(t.get("updatedAt"))),
]


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("template", aliases=["templates"], help="list, inspect and delete templates")
    actions = parser.add_subparsers(dest="action", required=True, metavar="<action>")
    listing = actions.add_parser("list", aliases=["ls"], parents=[output_flag()], help="list templates")
    listing.set_defaults(run=run_list)
    build = actions.add_parser("build", help="build a template from a Dockerfile or an image, with live logs")
    build.add_argument("context", nargs="?", default=".", help="build context directory (default: .)")
    build.add_argument("-f", "--file", dest="dockerfile", help="Dockerfile (default: CONTEXT/Dockerfile)")
    build.add_argument("--name", help="NAME[:TAG] of the template (default: the context directory's name)")
    build.add_argument("--from-image", help="base image (instead of the Dockerfile's FROM)")
    build.add_argument("--cpu", type=positive, help="vCPUs of the template's sandboxes")
    build.add_argument("--memory", type=positive, help="memory of the template's sandboxes in MiB")
    build.add_argument("--no-cache", action="store_true", help="run every step again")
    build.set_defaults(run=run_build)
    tag = actions.add_parser("tag", parents=[output_flag()], help="point more tags at a template's build")
    tag.add_argument("target", help="NAME[:TAG] of the build to tag (TAG defaults to default)")
    tag.add_argument("tags", nargs="+", metavar="tag", help="tags to assign")
    tag.set_defaults(run=run_tag)
    get = actions.add_parser(
        "get", aliases=["show", "info"], parents=[output_flag()], help="show one template"
    )
    get.add_argument("template", help="template ID or name")
    get.set_defaults(run=run_get)
    delete = actions.add_parser(
        "delete", aliases=["rm"], parents=[output_flag()], help="delete templates or snapshots"
    )
    delete.add_argument("templates", nargs="+", metavar="template", help="template or snapshot ID or name")
    delete.set_defaults(run=run_delete)


def run_list(args: argparse.Namespace) -> int:
    templates = list(api().pages("/v2/templates"))
    output.emit(templates, args.output, COLUMNS, "No templates.")
    return 0


def run_get(args: argparse.Namespace) -> int:
    template: dict[str, Any] = api().template(args.template)
    output.details(template, args.output)
    return 0


def run_delete(args: argparse.Namespace) -> int:
    client = api()
    deleted = []
    for name in args.templates:
        client.call("DELETE", f"/templates/{quote(name, safe='')}")
        deleted.append({"templateID": name, "deleted": True})
    output.done(deleted, "\n".join(f"Deleted {name}" for name in args.templates), args.output)
    return 0


def template_name(context: Path, name: str | None) -> str:
    """``--name``, else the context directory's name made a valid template name."""
    if name:
        return name
    derived = re.sub(r"[^a-z0-9._-]+", "-", context.resolve().name.lower()).strip("-._")
    return derived[:63] or "template"


def build_template(args: argparse.Namespace) -> Any:
    """The SDK template for the build: the Dockerfile's steps, on ``--from-image`` if given."""
    context = Path(args.context)
    if not context.is_dir():
        raise config.CLIError(f"build context {context} is not a directory")
    dockerfile = Path(args.dockerfile) if args.dockerfile else context / "Dockerfile"
    template = Template(file_context_path=str(context))
    if not dockerfile.is_file():
        if args.dockerfile or not args.from_image:
            raise config.CLIError(f"no Dockerfile at {dockerfile} (give -f FILE or --from-image REF)")
        return template.from_image(args.from_image)
    try:
        if args.from_image:
            builder = template.from_image(args.from_image)
            parse_dockerfile(str(dockerfile), builder)  # its FROM is replaced by --from-image
            return builder
        return template.from_dockerfile(str(dockerfile))
    except (DockerfileSyntaxError, ValueError) as exc:
        raise config.CLIError(f"cannot use {dockerfile}: {exc}") from exc


def run_build(args: argparse.Namespace) -> int:
    credentials = config.load()
    template = build_template(args)
    name = template_name(Path(args.context), args.name)

    def show(entry: Any) -> None:
        print(f"{entry.timestamp:%H:%M:%S} {entry.message}", file=sys.stderr, flush=True)

    try:
        info = Template.build(
            template, name, cpu_count=args.cpu or None, memory_mb=args.memory or None,
            skip_cache=args.no_cache, on_build_logs=show,
            api_key=credentials.api_key, api_url=credentials.url, domain=_domain(credentials.url),
            validate_api_key=False,
        )  # fmt: skip
    except (BuildException, FileUploadException, TemplateException) as exc:
        raise config.CLIError(f"build of {name} failed: {exc}") from exc
    print(f"Built {info.name} (template {info.template_id}, build {info.build_id})")
    return 0


def _domain(url: str) -> str:
    """The SDK wants a domain too; the node's own host stands in (the API URL is what it uses)."""
    return url.split("://", 1)[-1].split("/", 1)[0]


def run_tag(args: argparse.Namespace) -> int:
    target = args.target if ":" in args.target else f"{args.target}:default"
    answer = api().call("POST", "/templates/tags", json={"target": target, "tags": args.tags})
    output.done(
        answer,
        f"Tagged {target.split(':')[0]} build {answer['buildID']}: {', '.join(args.tags)}",
        args.output,
    )
    return 0
