# aenv: `make run` sets everything up and starts a node; `make test` runs the whole suite.
# Both are idempotent: system packages, the Python environment and the guest artifacts are
# installed or built only when missing or when their inputs changed.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: run test host-deps host-deps-runtime venv venv-test artifacts setup-console lint bench clean-venv

# A node needs only the runtime parts (host packages with --runtime, the package with its `server`
# extra, the console's xterm.js); the suite adds its own (a local registry, skopeo, Chromium, the
# `test` extra).
run: venv artifacts setup-console
	$(PY) -m aenv.cli server

test: venv-test artifacts setup-console
	$(PY) -m ruff check src tests bench
	$(PY) -m pytest $(PYTEST_ARGS)

host-deps-runtime:
	@bash scripts/install-host-deps.sh --runtime

host-deps:
	@bash scripts/install-host-deps.sh

# Each venv stamp is redone when pyproject.toml changes; `make run` then `make test` adds the
# test extra, `make test` alone sets everything up.
venv: $(VENV)/.installed-server
venv-test: $(VENV)/.installed-test

$(VENV)/.installed-server: pyproject.toml | host-deps-runtime
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[server]'
	@touch $@

$(VENV)/.installed-test: pyproject.toml | host-deps
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[server,test]'
	@touch $@

artifacts: venv
	$(PY) -m aenv.guest.artifacts

# The web console's browser dependencies (xterm.js), from its package-lock.json, served by the node.
CONSOLE := src/aenv/console
setup-console: host-deps-runtime $(CONSOLE)/node_modules/.package-lock.json

$(CONSOLE)/node_modules/.package-lock.json: $(CONSOLE)/package-lock.json
	npm ci --prefix $(CONSOLE) --no-audit --no-fund --loglevel=error

# Node-level benchmark on real VMs: one table against the targets, JSON in bench/results/.
# BENCH_MODE=quick (a few minutes), full, or smoke; BENCH_ARGS="--only create,resume --profile resume".
BENCH_MODE ?= quick
bench: venv-test artifacts
	$(PY) -m bench --mode $(BENCH_MODE) $(BENCH_ARGS)

lint: venv-test
	$(PY) -m ruff check src tests bench
	$(PY) -m ruff format --check src tests bench

clean-venv:
	rm -rf $(VENV)
