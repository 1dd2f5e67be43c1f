"""The web console in a real browser (Debian's headless Chromium driven by Playwright) against the
session's node and real VMs (and through a gateway over three nodes: tests/cluster/test_cluster_vm.py):
log in, see a sandbox created through the SDK, use its terminal (typing, paste, resize), pause and
resume it from the page and find the same shell still there. Screenshots of each view are saved
under the test's tmp dir."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import NodeServer, Sandboxes

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
    page = browser.new_page(viewport={"width": 1400, "height": 900})

    def shot(name: str) -> None:
        page.screenshot(path=str(tmp_path / f"console-{name}.png"), full_page=True)

    page.goto(f"{node.url}/console")
    page.fill("#key", node.key)
    page.click("#login button")
    row = page.locator(f'tr[data-id="{sandbox_id}"]')
    expect(row).to_contain_text("running", timeout=30_000)
    expect(row).to_contain_text("view=console")
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
