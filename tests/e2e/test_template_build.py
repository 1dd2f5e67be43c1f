"""Template builds through the official SDK (`Template.build`), on real build VMs.

A Debian image (with python3) is served by a local docker-registry; templates are built from it
and from `base` with every step type, a failing step, a cached rebuild, and sandboxes then start
from the results by name and tag. A matrix of images (Debian, busybox-static alone, no shell at
all) builds the same COPY and ENV steps.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Template, wait_for_file
from e2b.exceptions import BuildException
from prometheus_client.parser import text_string_to_metric_families

from aenv.snapshot.warm import WarmRecord
from tests.agent.images import image_tar
from tests.e2e.conftest import NodeServer, wait_until
from tests.e2e.test_js_sdk import installed_sdk, run_script
from tests.template.conftest import Registry, run_registry
from tests.template.debian import debian_layout
from tests.template.oci import directory, file, layer, single_image


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A local registry started for this module."""
    with run_registry(tmp_path_factory.mktemp("template-registry")) as running:
        yield running


@pytest.fixture(scope="module")
def image(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> str:
    """``<registry>/debian-py:12``: Debian with python3."""
    registry.push(debian_layout(tmp_path_factory.mktemp("debian") / "layout"), "12", "debian-py:12")
    return f"{registry.host}/debian-py:12"


# Distroless' accounts: no shell anywhere, no `user`.
NO_SHELL_PASSWD = (
    b"root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n"
    b"nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n"
)
NO_SHELL_GROUP = b"root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n"


@pytest.fixture(scope="module")
def matrix(image: str, registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The images template builds must work from: Debian; Debian's busybox-static alone (no libc,
    no `adduser` or `useradd`); and a distroless-like image without any shell."""
    workdir = tmp_path_factory.mktemp("matrix")
    busybox = [image_tar("busybox").read_bytes()]
    single_image(workdir / "busybox", busybox, {"Env": ["PATH=/bin:/sbin"]}, tag="1")
    registry.push(workdir / "busybox", "1", "busybox-static:1")
    no_shell = layer(
        directory("etc"), file("etc/passwd", NO_SHELL_PASSWD), file("etc/group", NO_SHELL_GROUP),
        file("etc/os-release", b"ID=aenv-no-shell\n"), directory("home"), directory("tmp", 0o1777),
    )  # fmt: skip
    single_image(workdir / "no-shell", [no_shell], {"Env": ["PATH=/bin"]}, tag="1")
    registry.push(workdir / "no-shell", "1", "no-shell:1")
    return {
        "debian": image,
        "busybox": f"{registry.host}/busybox-static:1",
        "no-shell": f"{registry.host}/no-shell:1",
    }


def build_context(root: Path) -> Path:
    (root / "app" / "lib").mkdir(parents=True)
    (root / "app" / "main.py").write_text("print('from the app')\n")
    (root / "app" / "lib" / "util.py").write_text("VALUE = 42\n")
    (root / "notes.txt").write_text("a note\n")
    return root


def delete_template(node: NodeServer, name: str) -> None:
    answer = httpx.delete(f"{node.url}/templates/{name}", headers={"X-API-Key": node.key})
    assert answer.status_code == 204, answer.text


def run(sandbox: Sandbox, cmd: str, **kwargs: object) -> str:
    return sandbox.commands.run(cmd, **kwargs).stdout.strip()


def test_build_from_a_registry_image_with_every_step_and_rebuild_from_cache(
    node: NodeServer, image: str, tmp_path: Path
) -> None:
    context = build_context(tmp_path)
    template = (
        Template(file_context_path=str(context))
        .from_image(image)
        .copy("app", "/opt/app", user="user", mode=0o750)
        .copy("notes.txt", "/srv/")
        .set_envs({"GREETING": "hello $IMAGE_VAR", "APP_HOME": "/opt/app"})
        .set_workdir("/opt/work")
        .run_cmd("echo running-as-$(whoami); echo $GREETING > greeting.txt", user="root")
        .set_user("builder")
        .run_cmd("whoami > /tmp/who && pwd >> /tmp/who")
        .set_start_cmd(
            "python3 -m http.server 8123 --directory /srv & touch /tmp/started; wait",
            wait_for_file("/tmp/started"),
        )
    )
    logs: list[str] = []
    info = Template.build(template, "e2e-image:v1", on_build_logs=lambda e: logs.append(e.message))
    assert info.template_id == "e2e-image"
    text = "\n".join(logs)
    assert "running-as-root" in text, text
    assert Template.exists("e2e-image")
    assert [t.tag for t in Template.get_tags("e2e-image")] == ["v1"]

    sandbox = Sandbox.create("e2e-image:v1")
    try:
        # /opt/app is the user's, mode 750: not for `builder`, the default user now
        owners = run(sandbox, "stat -c '%U %a' /opt/app/main.py /opt/app/lib/util.py", user="root")
        assert owners == "user 750\nuser 750"
        assert (
            run(sandbox, "cat /opt/app/main.py /srv/notes.txt", user="user")
            == "print('from the app')\na note"
        )
        assert run(sandbox, "echo $GREETING:$APP_HOME") == "hello from-image:/opt/app"
        assert run(sandbox, "cat greeting.txt; whoami; pwd") == "hello from-image\nbuilder\n/opt/work"
        assert run(sandbox, "cat /tmp/who") == "builder\n/opt/work"
        fetched = "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8123/notes.txt').read())\""
        assert "a note" in run(sandbox, fetched)  # the start command kept running in the snapshot
    finally:
        sandbox.kill()

    logs.clear()
    Template.build(template, "e2e-image:v2", on_build_logs=lambda e: logs.append(e.message))
    cached = [line for line in logs if line.startswith("CACHED")]
    assert len(cached) == 8, logs  # the base step and all seven steps
    assert sorted(t.tag for t in Template.get_tags("e2e-image")) == ["v1", "v2"]
    Template.remove_tags("e2e-image", ["v1"])
    assert [t.tag for t in Template.get_tags("e2e-image")] == ["v2"]
    delete_template(node, "e2e-image")
    assert not Template.exists("e2e-image")


@pytest.mark.parametrize("kind", ["debian", "busybox", "no-shell"])
def test_images_without_user_tools_tar_or_shell_build_templates(
    node: NodeServer, matrix: dict[str, str], kind: str, tmp_path: Path
) -> None:
    """The same COPY and ENV steps in each image, a USER and a RUN where there is a shell; envd
    creates `user` (and `builder`) itself and unpacks COPY without the image's tar."""
    shell = kind != "no-shell"
    template = (
        Template(file_context_path=str(build_context(tmp_path)))
        .from_image(matrix[kind])
        .copy("app", "/opt/app", user="user", mode=0o750)
        .copy("notes.txt", "/srv/")
        .set_envs({"PLAIN": "as written"})
    )
    if shell:
        template = template.set_user("builder").run_cmd("whoami > /tmp/who; echo $PLAIN >> /tmp/who")
    name = f"e2e-matrix-{kind}"
    Template.build(template, name)
    sandbox = Sandbox.create(name)
    try:
        for path in ("/opt/app/main.py", "/opt/app/lib/util.py"):
            copied = sandbox.files.get_info(path, user="root")
            assert (copied.owner, copied.group, copied.mode & 0o7777) == ("user", "user", 0o750), path
        assert sandbox.files.read("/opt/app/lib/util.py", user="user") == "VALUE = 42\n"
        assert sandbox.files.read("/srv/notes.txt", user="root") == "a note\n"
        home = sandbox.files.get_info("/home/user", user="root")
        assert (home.owner, home.group, home.mode & 0o7777) == ("user", "user", 0o755)
        passwd = sandbox.files.read("/etc/passwd", user="root")
        assert passwd.count("\nuser:x:") == 1, passwd
        if shell:
            assert (
                run(sandbox, "cat /tmp/who; whoami; echo $PLAIN")
                == "builder\nas written\nbuilder\nas written"
            )
            assert run(sandbox, "id -un; ls -ld /home/user | cut -c1-10", user="user") == "user\ndrwxr-xr-x"
    finally:
        sandbox.kill()
    delete_template(node, name)
    if not shell:
        with pytest.raises(BuildException, match="RUN needs /bin/sh, which the image does not have"):
            Template.build(Template().from_image(matrix[kind]).run_cmd("echo never"), "e2e-matrix-run")


def peak_rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))


def test_a_large_copy_streams_from_the_node_s_disk(node: NodeServer, tmp_path: Path) -> None:
    """The node never holds a COPY's archive: its peak RSS over a 200 MiB COPY grows by far less
    than the archive (before the upload was streamed, it grew by about five times its size)."""
    big = os.urandom(200 << 20)
    (tmp_path / "big.bin").write_bytes(big)
    assert node.pid is not None
    Path(f"/proc/{node.pid}/clear_refs").write_text("5")  # the peak restarts from the current RSS
    before = peak_rss_kib(node.pid)
    template = Template(file_context_path=str(tmp_path)).from_template("base").copy("big.bin", "/opt/big.bin")
    Template.build(template, "e2e-large-copy")
    growth_mib = (peak_rss_kib(node.pid) - before) >> 10
    assert growth_mib < 64, f"the node's peak RSS grew by {growth_mib} MiB during a 200 MiB COPY"
    sandbox = Sandbox.create("e2e-large-copy")
    try:
        assert run(sandbox, "stat -c '%s %U' /opt/big.bin") == f"{200 << 20} root"
        tail = hashlib.sha256(big[-4096:]).hexdigest()
        assert run(sandbox, "tail -c 4096 /opt/big.bin | sha256sum") == f"{tail}  -"
    finally:
        sandbox.kill()
    delete_template(node, "e2e-large-copy")


def warm_vms(node: NodeServer, snapshot_id: str) -> int:
    """The node's ready warm VMs of a snapshot (their records under its runtime say so)."""
    return WarmRecord.ready_count(node.home / "runtime" / "warm", snapshot_id)


def test_build_from_base_then_a_failing_step(node: NodeServer) -> None:
    template = (
        Template().from_template("base").set_envs({"MARK": "from-base"}).run_cmd("echo $MARK > /tmp/mark")
    )
    Template.build(template, "e2e-on-base", min_free_disk_mb=6000)
    sandbox = Sandbox.create("e2e-on-base")
    try:
        assert run(sandbox, "cat /tmp/mark; whoami") == "from-base\nuser"
        assert int(run(sandbox, "df -Pm / | awk 'NR==2 {print $4}'")) >= 6000  # base has less
        # creates from a new build start from warm VMs, as from `base`, without a node restart
        built = Sandbox.get_info(sandbox.sandbox_id).template_id
        wait_until(lambda: warm_vms(node, built) > 0, 120, what="warm VMs of the new template")
    finally:
        sandbox.kill()

    failing = (
        Template().from_template("e2e-on-base").run_cmd("echo fine").run_cmd("echo about-to-fail; exit 3")
    )
    logs: list[str] = []
    with pytest.raises(BuildException, match="step 2") as failure:
        Template.build(failing, "e2e-failing", on_build_logs=lambda e: logs.append(e.message))
    assert "exit" in str(failure.value) or "code 3" in str(failure.value)
    assert "about-to-fail" in "\n".join(logs)
    staging = node.home / "repository" / "staging"
    assert not staging.exists() or not list(staging.iterdir())
    assert not any("aenv-b" in name for name in node.owned_netns())
    with pytest.raises(Exception):  # noqa: B017 - nothing was committed under the name
        Sandbox.create("e2e-failing")

    # a start command that fails ends the build at once, with its exit code, at finalize
    broken_start = Template().from_template("e2e-on-base").set_start_cmd("exit 4", "false")
    with pytest.raises(BuildException, match="finalize") as failure:
        Template.build(broken_start, "e2e-failing")
    assert "'exit 4' exited with code 4" in str(failure.value)
    delete_template(node, "e2e-on-base")
    # every build is timed, by how it ended (aenv.telemetry)
    metrics = httpx.get(f"{node.url}/metrics", timeout=30).text
    builds = {
        s.labels["outcome"]: s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name.endswith("_count") and s.labels.get("operation") == "template_build"
    }
    assert builds["ok"] >= 1 and builds["error"] >= 2


def test_uploads_need_a_valid_signature(node: NodeServer) -> None:
    headers = {"X-API-Key": node.key}
    with httpx.Client(base_url=node.url, headers=headers) as api:
        created = api.post("/v3/templates", json={"name": "e2e-uploads"})
        assert created.status_code == 202
        template_id = created.json()["templateID"]
        assert api.get(f"/templates/{template_id}/files/not-a-hash").status_code == 400
        link = api.get(f"/templates/{template_id}/files/{'a' * 64}")
        assert link.status_code == 201 and link.json()["present"] is False
        url = httpx.URL(link.json()["url"])
    with httpx.Client() as anonymous:
        for bad in (
            url.copy_set_param("signature", "0" * 64),
            url.copy_set_param("expires", "1"),
            url.copy_with(path=f"/templates/{template_id}/files/{'b' * 64}"),
        ):
            refused = anonymous.put(bad, content=b"data")
            assert refused.status_code == 403, refused.text
            assert set(refused.json()) >= {"code", "message"}
        assert anonymous.put(url, content=b"not a tar").status_code == 200
    with httpx.Client(base_url=node.url, headers=headers) as api:
        # stored but not trusted: only a build that checked it against its hash marks it present
        assert api.get(f"/templates/{template_id}/files/{'a' * 64}").json()["present"] is False


JS_BUILD = r"""
import { Sandbox, Template, waitForFile } from 'e2b'

const opts = { apiKey: process.env.AENV_E2E_KEY, apiUrl: process.env.AENV_E2E_URL,
               sandboxUrl: process.env.AENV_E2E_URL }
const template = Template({ fileContextPath: new URL('js-context', import.meta.url).pathname })
  .fromTemplate('base')
  .copy('notes.txt', '/opt/js/')
  .setEnvs({ FROM_JS: 'npm' })
  .runCmd('echo built-by-$FROM_JS > /opt/js/built.txt', { user: 'root' })
  .setStartCmd('sleep 86400 & touch /tmp/js-started; wait', waitForFile('/tmp/js-started'))
const logs = []
const info = await Template.build(template, 'e2e-js:v1',
                                  { ...opts, onBuildLogs: (e) => logs.push(e.message) })
const sbx = await Sandbox.create('e2e-js:v1', opts)
try {
  const check = 'cat /opt/js/notes.txt /opt/js/built.txt; pgrep -x sleep >/dev/null && echo kept'
  const run = await sbx.commands.run(check)
  console.log(JSON.stringify({ name: info.name, templateId: info.templateId, out: run.stdout, logs }))
} finally {
  await sbx.kill()
}
"""


def test_npm_sdk_builds_a_template(node: NodeServer, tmp_path: Path) -> None:
    sdk = installed_sdk(tmp_path)
    context = sdk / "js-context"
    context.mkdir(exist_ok=True)
    (context / "notes.txt").write_text("from the npm context\n")
    outcome = run_script(node, sdk, "build.mjs", JS_BUILD)
    assert outcome["templateId"] == "e2e-js", outcome
    # the COPY, the ENV expanded by the RUN, and the start command kept running in the snapshot
    assert outcome["out"] == "from the npm context\nbuilt-by-npm\nkept\n", outcome
    assert any("[start cmd]" in line for line in outcome["logs"]), outcome["logs"]
    delete_template(node, "e2e-js")


def aenv_cli(node: NodeServer, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AENV_URL": node.url, "AENV_API_KEY": node.key}
    command = [sys.executable, "-m", "aenv.cli", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)


def test_cli_builds_a_dockerfile(node: NodeServer, image: str, tmp_path: Path) -> None:
    context = build_context(tmp_path / "ctx")
    (context / "Dockerfile").write_text(
        f"FROM {image}\nCOPY app /opt/cli-app\nENV CLI_VAR=cli\nWORKDIR /opt/cli-app\n"
        "RUN echo built-by-$CLI_VAR > built.txt\n"
    )
    built = aenv_cli(node, "template", "build", str(context), "--name", "e2e-cli:latest")
    assert built.returncode == 0, built.stderr
    assert "Built e2e-cli:latest" in built.stdout and "built.txt" in built.stderr  # the live log
    sandbox = Sandbox.create("e2e-cli:latest")
    try:
        assert run(sandbox, "cat built.txt lib/util.py") == "built-by-cli\nVALUE = 42"
    finally:
        sandbox.kill()
    assert "e2e-cli" in aenv_cli(node, "template", "info", "e2e-cli", "-o", "json").stdout

    (context / "Broken").write_text(f"FROM {image}\nRUN echo fine\nRUN echo failing-now; exit 5\n")
    failed = aenv_cli(
        node, "template", "build", str(context), "-f", str(context / "Broken"), "--name", "e2e-cli"
    )
    assert failed.returncode != 0
    # the SDK's converter starts with USER root and WORKDIR / (Docker's defaults): the RUN is step 4
    assert "step 4" in failed.stderr and "failing-now" in failed.stderr
    assert aenv_cli(node, "template", "rm", "e2e-cli").returncode == 0
