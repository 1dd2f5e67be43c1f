"""The web console in a real browser (Debian's headless Chromium driven by Playwright) against the
session's node and real VMs (and through a gateway over three nodes: tests/cluster/test_cluster_vm.py):
log in, see a sandbox created through the SDK, use its terminal (typing, paste, resize), pause and
resume it from the page and find the same shell still there; checkpoint, snapshot, fork, set the
timeout and kill from the page, see the snapshot under its sandbox's template; build a template
from the page and watch its log arrive while it runs. Screenshots of each view are saved under the
test's tmp dir."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import NodeServer, Sandboxes, wait_until

pytestmark = pytest.mark.vm

SLOW_MS = 180_000  # TCG: a pause or resume takes tens of seconds on a busy machine
ROWS_JS = "Array.from(document.querySelectorAll('#terminal .xterm-rows > div'), d => d.textContent.trim())"


@pytest.fixture
def browser() -> Iterator[Any]:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("Debian's chromium is not installed (scripts/install-host-deps.sh installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # --no-sandbox: Chromium's own sandbox refuses to run as root, as the test suite does.
        launched = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


def log_in(browser: Any, node: NodeServer, tmp_path: Path) -> tuple[Any, Callable[[str], None]]:
    """A page logged in to the node's console, and a function saving a screenshot of it."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})

    def shot(name: str) -> None:
        page.screenshot(path=str(tmp_path / f"console-{name}.png"), full_page=True)

    page.goto(f"{node.url}/console")
    page.fill("#key", node.key)
    page.click("#login button")
    return page, shot


def api(node: NodeServer) -> httpx.Client:
    return httpx.Client(base_url=node.url, headers={"X-API-Key": node.key}, timeout=300)


def wait_for_line(page: Any, line: str) -> None:
    """Until a terminal row reads exactly `line` (the command's output, not its echo)."""
    page.wait_for_function(f"{ROWS_JS}.includes({line!r})", timeout=SLOW_MS)


def rows(page: Any) -> list[str]:
    return page.evaluate(ROWS_JS)


def pty_columns(page: Any, marker: str) -> int:
    """The PTY's width as the shell sees it (`stty size`), printed after `marker`."""
    page.keyboard.type(f"stty size | sed 's/^/{marker}=/'\n")
    page.wait_for_function(f"{ROWS_JS}.some(row => row.startsWith('{marker}='))", timeout=SLOW_MS)
    line = next(row for row in rows(page) if row.startswith(f"{marker}="))
    return int(line.split("=")[1].split()[1])


def paste(page: Any, text: str) -> None:
    """A clipboard paste into the terminal, as the browser delivers Ctrl-V."""
    page.evaluate(
        """text => { const data = new DataTransfer(); data.setData('text/plain', text);
        document.querySelector('#terminal textarea').dispatchEvent(
            new ClipboardEvent('paste', {clipboardData: data, bubbles: true, cancelable: true})); }""",
        text,
    )


def test_console_terminal_across_pause_and_resume(
    node: NodeServer, sandboxes: Sandboxes, browser: Any, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    sandbox_id = sandboxes.create(metadata={"view": "console"}).sandbox_id
    page, shot = log_in(browser, node, tmp_path)
    row = page.locator(f'tr[data-id="{sandbox_id}"]')
    expect(row).to_contain_text("running", timeout=30_000)
    expect(row).to_contain_text("view=console")
    with api(node) as client:  # the node that holds it (a gateway's list names it; a node is its own)
        holder = client.get(f"/sandboxes/{sandbox_id}").json()["clientID"]
        nodes = [n["id"] for n in client.get("/nodes").json()]
    expect(row.locator("td.node")).to_have_text(holder if holder in nodes else nodes[0])
    shot("sandboxes")

    page.click("nav button[data-view=nodes]")
    expect(page.locator("main tbody tr").first).to_be_visible(timeout=30_000)  # a gateway lists several
    shot("nodes")
    page.click("nav button[data-view=templates]")
    expect(page.locator("main tbody tr").first).to_contain_text("ready", timeout=30_000)
    shot("templates")

    page.click("nav button[data-view=sandboxes]")
    page.click(f"text={sandbox_id}")
    page.wait_for_selector("#terminal .xterm-rows", timeout=30_000)
    page.wait_for_function(f"{ROWS_JS}.some(row => row.endsWith('$'))", timeout=SLOW_MS)  # the prompt
    page.click("#terminal")
    page.keyboard.type("KEPT=across-pause; echo hi\n")
    wait_for_line(page, "hi")
    paste(page, "echo pasted-$((6*7))")
    page.keyboard.press("Enter")
    wait_for_line(page, "pasted-42")
    wide = pty_columns(page, "wide")
    page.set_viewport_size({"width": 1000, "height": 900})
    assert pty_columns(page, "narrow") < wide
    page.set_viewport_size({"width": 1400, "height": 900})
    expect(page.locator("section", has_text="Files")).to_contain_text("..", timeout=30_000)
    shot("sandbox")

    page.click("main button:text-is('Pause')")
    expect(page.locator("main .state-paused")).to_be_visible(timeout=SLOW_MS)
    expect(page.locator("h2", has_text="Terminal")).to_contain_text("paused", timeout=30_000)
    shot("paused")
    page.click("main button:text-is('Resume')")
    expect(page.locator("h2", has_text="Terminal")).to_contain_text("resumed", timeout=SLOW_MS)
    page.click("#terminal")
    page.keyboard.type("echo still-$KEPT\n")
    wait_for_line(page, "still-across-pause")
    # A CPU figure once envd has sampled (every 5 s).
    expect(page.locator("div.legend")).not_to_contain_text("CPU \u2013 %", timeout=60_000)
    shot("resumed")


def test_console_actions_lineage_and_a_build(
    node: NodeServer, sandboxes: Sandboxes, browser: Any, tmp_path: Path
) -> None:
    """Checkpoint, snapshot, fork, timeout and kill from the page, the snapshot's lineage, and a
    template built from the page with its log arriving while it runs."""
    from playwright.sync_api import expect

    sandbox_id = sandboxes.create(metadata={"view": "actions"}).sandbox_id
    page, shot = log_in(browser, node, tmp_path)
    replies: list[str] = []  # what the next prompt() is answered; confirm() is accepted
    page.on("dialog", lambda dialog: dialog.accept(replies.pop(0) if dialog.type == "prompt" else None))
    row = page.locator(f'tr[data-id="{sandbox_id}"]')
    expect(row).to_contain_text("running", timeout=30_000)
    name = f"console-{uuid.uuid4().hex[:8]}"
    leftovers = [f"/templates/{name}"]  # deleted from the page, or at the end if the test failed
    with api(node) as client:
        try:
            ended = client.get(f"/sandboxes/{sandbox_id}").json()["endAt"]
            row.locator("button:text-is('Checkpoint')").click()
            checkpoint = wait_for(lambda: client.get(f"/sandboxes/{sandbox_id}/checkpoints").json())[0]
            row.locator("button:text-is('Snapshot')").click()
            snapshot = wait_for(lambda: client.get("/snapshots", params={"sandboxID": sandbox_id}).json())[0]
            leftovers.append(f"/templates/{snapshot['snapshotID']}")
            started_from = checkpoint["parent"].removeprefix("snapshot:")  # the template's snapshot
            assert snapshot["source"] == {
                "sandboxID": sandbox_id, "snapshotID": started_from,
                "checkpointID": checkpoint["checkpointID"],
            }  # fmt: skip
            replies.append("900")
            row.locator("button:text-is('Timeout')").click()
            wait_for(lambda: client.get(f"/sandboxes/{sandbox_id}").json()["endAt"] > ended)
            replies.append("1")
            row.locator("button:text-is('Fork')").click()
            children = page.locator("tbody tr", has_text="view=actions").filter(has_not_text=sandbox_id)
            expect(children).to_have_count(1, timeout=SLOW_MS)
            child = children.first.get_attribute("data-id")
            sandboxes.track(child)
            shot("actions")
            children.first.locator("button:text-is('Kill')").click()
            expect(children).to_have_count(0, timeout=SLOW_MS)
            assert client.get(f"/sandboxes/{child}").status_code == 404

            page.click(f"text={sandbox_id}")  # its checkpoint, and its parent: the template's snapshot
            expect(page.locator(f'tr[data-id="{checkpoint["checkpointID"]}"]')).to_contain_text(
                checkpoint["parent"], timeout=30_000
            )
            shot("checkpoints")
            page.click("nav button[data-view=snapshots]")
            branch = page.locator(f'li.root:has(li[data-id="{snapshot["snapshotID"]}"])')
            expect(branch.locator("> strong")).to_have_text(started_from, timeout=30_000)
            expect(branch).to_contain_text("template base")
            origin = f"of sandbox {sandbox_id}, checkpoint {checkpoint['checkpointID']}"
            expect(branch).to_contain_text(origin)
            shot("snapshots")
            branch.locator(f'li[data-id="{snapshot["snapshotID"]}"] > button:text-is("Delete")').click()
            expect(page.locator(f'li[data-id="{snapshot["snapshotID"]}"]')).to_have_count(0, timeout=30_000)

            page.click("nav button[data-view=templates]")
            page.fill("input[name=template]", name)
            page.fill("textarea[name=steps]", "echo console-first; sleep 8; echo console-second")
            page.click("button:text-is('Build')")
            build = page.locator("section.build")
            # A line of the running step shows while the build still runs.
            page.wait_for_function(
                """() => { const b = document.querySelector('section.build');
                return b && b.querySelector('pre').textContent.includes('console-first')
                  && b.querySelector('.status').textContent === 'building'; }""",
                timeout=SLOW_MS,
            )
            shot("build")
            expect(build.locator(".status")).to_have_text("ready", timeout=SLOW_MS)
            expect(build.locator("pre")).to_contain_text("console-second")
            template = page.locator("tbody tr", has=page.locator("td", has_text=name))
            expect(template.locator("td.tags")).to_contain_text("default", timeout=30_000)
            shot("templates")
            template.locator("button:text-is('Delete')").click()
            expect(template).to_have_count(0, timeout=30_000)
        finally:
            for path in leftovers:
                client.delete(path)


def wait_for(read: Callable[[], Any]) -> Any:
    """What `read` returns once it is truthy (the page's action has taken effect)."""
    return wait_until(read, SLOW_MS / 1000, interval=0.5, what="the page's action to take effect")
