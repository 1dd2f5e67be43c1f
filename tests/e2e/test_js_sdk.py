"""Smoke test with the official `e2b` npm SDK (pinned in `js/package.json`): create, run, files, pause,
connect, kill. The package is installed with `npm ci` into a cache directory outside the repository."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import NodeServer

pytestmark = pytest.mark.vm

JS_DIR = Path(__file__).parent / "js"

SCRIPT = r"""
import { Sandbox } from 'e2b'

const opts = { apiKey: process.env.AENV_E2E_KEY, apiUrl: process.env.AENV_E2E_URL,
               sandboxUrl: process.env.AENV_E2E_URL }
const steps = []
const check = (name, ok, detail) => {
  steps.push(name)
  if (!ok) throw new Error(`${name} failed: ${JSON.stringify(detail)}`)
}

const sbx = await Sandbox.create('base', { ...opts, timeoutMs: 120_000, metadata: { e2e: 'js' },
                                           envs: { FROM_JS: 'yes' } })
let killed = false
try {
  check('create', /^[a-z0-9]+$/.test(sbx.sandboxId), sbx.sandboxId)
  const run = await sbx.commands.run('echo "$FROM_JS $((40+2))"')
  check('run', run.stdout === 'yes 42\n' && run.exitCode === 0, run)
  const bg = await sbx.commands.run('sleep 300', { background: true })
  await sbx.files.write('/home/user/js.txt', 'from node')
  check('files.read', (await sbx.files.read('/home/user/js.txt')) === 'from node')
  const listed = await sbx.files.list('/home/user')
  check('files.list', listed.some((e) => e.name === 'js.txt'), listed.map((e) => e.name))
  check('files.exists', await sbx.files.exists('/home/user/js.txt'))
  const info = await Sandbox.getInfo(sbx.sandboxId, opts)
  check('getInfo', info.state === 'running' && info.metadata.e2e === 'js', info)

  check('pause', await sbx.pause() !== false)
  check('paused', (await Sandbox.getInfo(sbx.sandboxId, opts)).state === 'paused')
  check('isRunning after pause', !(await sbx.isRunning()))

  const resumed = await Sandbox.connect(sbx.sandboxId, opts)
  check('connect', (await Sandbox.getInfo(sbx.sandboxId, opts)).state === 'running')
  check('files kept', (await resumed.files.read('/home/user/js.txt')) === 'from node')
  const procs = await resumed.commands.list()
  check('process kept', procs.some((p) => p.pid === bg.pid), procs)

  check('kill', await resumed.kill() !== false)
  killed = true
  const gone = await Sandbox.list({ ...opts, query: { metadata: { e2e: 'js' } } }).nextItems()
  check('gone', !gone.some((s) => s.sandboxId === sbx.sandboxId), gone)
} finally {
  if (!killed) await Sandbox.kill(sbx.sandboxId, opts).catch(() => {})
}
console.log(JSON.stringify({ ok: true, steps }))
"""


def installed_sdk(tmp_root: Path) -> Path:
    """A directory with the pinned SDK in node_modules, reused while the lock file is unchanged."""
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            pytest.fail(f"`{tool}` is not installed: the npm SDK smoke test needs Node.js 18+ and npm")
    lock = (JS_DIR / "package-lock.json").read_bytes()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "aenv-e2e"
    target = cache / f"npm-{hashlib.sha256(lock).hexdigest()[:16]}"
    if not (target / "node_modules" / "e2b" / "package.json").exists():
        staging = tmp_root / "npm-install"
        staging.mkdir()
        shutil.copy(JS_DIR / "package.json", staging)
        shutil.copy(JS_DIR / "package-lock.json", staging)
        result = subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=staging, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if result.returncode != 0:
            pytest.fail(f"npm ci failed (is the npm registry reachable?):\n{result.stdout}\n{result.stderr}")
        cache.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    return target


def run_script(node: NodeServer, sdk: Path, name: str, source: str) -> dict:
    """Run a script with the installed npm SDK against the node; the JSON its last line prints."""
    script = sdk / name
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(AENV_E2E_URL=node.url, AENV_E2E_KEY=node.key)
    result = subprocess.run(
        ["node", str(script)], cwd=sdk, env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_js_sdk_smoke(node: NodeServer, tmp_path: Path) -> None:
    sdk = installed_sdk(tmp_path)
    pinned = json.loads((JS_DIR / "package.json").read_text())["dependencies"]["e2b"]
    assert json.loads((sdk / "node_modules" / "e2b" / "package.json").read_text())["version"] == pinned
    outcome = run_script(node, sdk, "smoke.mjs", SCRIPT)
    assert outcome["ok"] and "gone" in outcome["steps"], outcome
