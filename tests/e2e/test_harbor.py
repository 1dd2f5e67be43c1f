"""Harbor's E2B environment, unchanged, against a real node: `harbor run --env e2b` with its oracle agent.

Harbor needs Python >= 3.12, so it runs from a Debian trixie tree (mmdebstrap, python3.13, `pip
install harbor[e2b]`) built once per cache, in a private mount namespace (`/proc`, `/dev` and
the job's directory mounted there, all gone with it). The task is Harbor's format: its
Dockerfile starts `FROM` a Debian image in a local registry and uses ENV, COPY, RUN, USER and
WORKDIR; Harbor builds a template from it (`Template.from_dockerfile`, `build_in_background`,
`get_build_status`), starts the trial's sandbox from `<name>:<build id>`, runs the oracle's
`solution/solve.sh` and the verifier's `tests/test.sh`, which must write reward 1: against the
session's node, and against the gateway of a one-node cluster.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.devcluster import ClusterProcess
from aenv.guest.cache import cached_build, inputs_key
from aenv.guest.rootfs import MIRROR
from tests.e2e.conftest import NodeServer
from tests.fusion.test_fusion_gateway import front  # noqa: F401 - the gateway of a one-node cluster
from tests.template.conftest import run_registry
from tests.template.debian import debian_layout

pytestmark = pytest.mark.vm

HARBOR = "harbor[e2b]==0.26.0"
SUITE = "trixie"  # Harbor needs Python >= 3.12: trixie's is 3.13
TREE_PACKAGES = "python3,python3-venv,ca-certificates"
READY = "ready"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")  # what the host trusts, for pip in the tree
RUN_TIMEOUT = 3600

DOCKERFILE = """\
FROM {image}
ENV GREETING=hello
COPY data.txt /opt/task/data.txt
RUN test -f /opt/task/data.txt && echo built > /opt/task/built.txt
USER worker
WORKDIR /home/worker/app
"""
SOLVE = '#!/bin/bash\necho "$GREETING $(cat /opt/task/data.txt) $(whoami) $PWD" > /tmp/answer.txt\n'
TEST = """\
#!/bin/bash
mkdir -p /logs/verifier
answer="$(cat /tmp/answer.txt)"
if [ "$answer" = "hello harbor-data worker /home/worker/app" ] && [ -f /opt/task/built.txt ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
"""
TASK_TOML = """\
schema_version = "1.4"

[metadata]

[verifier]
timeout_sec = 600.0

[agent]
timeout_sec = 600.0

[environment]
build_timeout_sec = 1800.0
"""


def _build_tree(out: Path) -> None:
    root = out / "root"
    subprocess.run(
        ["mmdebstrap", "--variant=apt", f"--include={TREE_PACKAGES}", SUITE, str(root), MIRROR],
        check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    if HOST_CA.exists():  # a host behind a TLS-intercepting proxy trusts its CA: so must pip here
        shutil.copy(HOST_CA, root / HOST_CA.relative_to("/"))
    (root / "work").mkdir()
    in_tree(root, out, ["python3", "-m", "venv", "/opt/harbor"])
    in_tree(root, out, ["/opt/harbor/bin/pip", "install", "--quiet", HARBOR])
    (out / READY).touch()


def in_tree(root: Path, work: Path, argv: list[str], env: dict[str, str] | None = None) -> str:
    """Run `argv` chrooted in `root` with `work` at /work, in a mount namespace of its own."""
    script = (
        'mount -t proc proc "$0/proc" && mount --rbind /dev "$0/dev" && mount --bind "$1" "$0/work" '
        '&& root="$0" && shift && exec chroot "$root" "$@"'
    )
    base = {
        "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        "HOME": "/root",
        "SSL_CERT_FILE": str(HOST_CA),
    }
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(root), str(work), *argv],
        env=base | (env or {}), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )  # fmt: skip
    assert result.returncode == 0, (
        f"{argv[0]} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    )
    return result.stdout


@pytest.fixture(scope="module")
def harbor_tree() -> Path:
    key = inputs_key(suite=SUITE, mirror=MIRROR, harbor=HARBOR, packages=TREE_PACKAGES)
    return cached_build("harbor-tree", key, _build_tree, READY) / "root"


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("harbor-registry")
    with run_registry(workdir / "registry") as registry:
        registry.push(debian_layout(workdir / "layout"), "12", "debian-py:12")
        yield f"{registry.host}/debian-py:12"


def write_task(task: Path, image: str) -> None:
    files = {
        "task.toml": TASK_TOML,
        "instruction.md": "Write the greeting, the data, your user and directory to /tmp/answer.txt.\n",
        "environment/Dockerfile": DOCKERFILE.format(image=image),
        "environment/data.txt": "harbor-data",
        "solution/solve.sh": SOLVE,
        "tests/test.sh": TEST,
    }
    for name, text in files.items():
        (task / name).parent.mkdir(parents=True, exist_ok=True)
        (task / name).write_text(text)
    for script in ("solution/solve.sh", "tests/test.sh"):
        (task / script).chmod(0o755)


@pytest.mark.parametrize("entrance", ["node", "gateway"])
def test_harbor_oracle_runs_to_reward_1(
    entrance: str, request: pytest.FixtureRequest, harbor_tree: Path, image: str, tmp_path: Path
) -> None:
    if entrance == "node":
        node: NodeServer = request.getfixturevalue("node")
        url, key = node.url, node.key
    else:
        gateway: ClusterProcess = request.getfixturevalue("front")
        url, key = gateway.url, gateway.key
    write_task(tmp_path / "task", image)
    env = {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": key}
    output = in_tree(
        harbor_tree, tmp_path,
        ["/opt/harbor/bin/harbor", "run", "--yes", "--env", "e2b", "--agent", "oracle",
         "--path", "/work/task", "--jobs-dir", "/work/jobs", "--n-concurrent", "1"],
        env,
    )  # fmt: skip
    results = [json.loads(p.read_text()) for p in (tmp_path / "jobs").rglob("result.json")]
    trials = [r for r in results if "verifier_result" in r]
    assert trials, f"no trial result:\n{output}"
    for trial in trials:
        assert trial.get("exception_info") is None, trial["exception_info"]
        assert trial["verifier_result"]["rewards"] == {"reward": 1}, trial["verifier_result"]
