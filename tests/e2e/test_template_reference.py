"""Sandboxes from `name:<build id>`, as Harbor starts them, through the official SDK on a real node.

Harbor's E2B environment pins each trial to the build it resolved (`name:<build id>`), so a
rebuild cannot change a running job, and it waits for a build another process started only when
create's 404 says the tag "does not exist", E2B's wording.
"""

from __future__ import annotations

import pytest
from e2b import Sandbox, Template
from e2b.exceptions import SandboxException

from tests.e2e.conftest import NodeServer, Sandboxes, run_in
from tests.e2e.test_template_build import delete_template

NAME = "e2e-build-ref"


def test_create_from_a_build_id_and_e2bs_404_for_a_missing_tag(
    node: NodeServer, sandboxes: Sandboxes
) -> None:
    template = Template().from_template("base").run_cmd("echo pinned > /tmp/mark")
    built = Template.build(template, f"{NAME}:v1")
    try:
        sandbox = sandboxes.create(f"{NAME}:{built.build_id}")
        assert run_in(sandbox, "cat /tmp/mark").strip() == "pinned"
        assert run_in(sandboxes.create(f"{NAME}:v1"), "cat /tmp/mark").strip() == "pinned"
        with pytest.raises(SandboxException) as missing:
            Sandbox.create(f"{NAME}:v2")
        assert missing.value.status_code == 404  # what Harbor checks, with the wording below
        assert f"tag 'v2' does not exist for template '{NAME}'" in str(missing.value)
    finally:
        for sandbox_id in sandboxes.ids:
            Sandbox.kill(sandbox_id)
        sandboxes.ids.clear()
        delete_template(node, NAME)
