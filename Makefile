# aenv: `make run` sets everything up and starts a node; `make test` runs the whole suite.
# Both are idempotent: system packages, the Python environment and the guest artifacts are
# installed or built only when missing or when their inputs changed.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: run test host-deps venv artifacts setup-console lint bench clean-venv

run: venv artifacts setup-console
	$(PY) -m aenv.cli server

test: venv artifacts setup-console
	$(PY) -m ruff check src tests bench
	$(PY) -m pytest $(PYTEST_ARGS)

host-deps:
	@bash scripts/install-host-deps.sh

# The venv is rebuilt when pyproject.toml changes (the stamp records its content).
venv: host-deps $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

artifacts: venv
	$(PY) -m aenv.guest.artifacts

# The web console's browser dependencies (xterm.js), from its package-lock.json, served by the node.
CONSOLE := src/aenv/console
setup-console: host-deps $(CONSOLE)/node_modules/.package-lock.json

$(CONSOLE)/node_modules/.package-lock.json: $(CONSOLE)/package-lock.json
	npm ci --prefix $(CONSOLE) --no-audit --no-fund --loglevel=error

# Node-level benchmark on real VMs: one table against the targets, JSON in bench/results/.
# BENCH_MODE=quick (a few minutes), full, or smoke; BENCH_ARGS="--only create,resume --profile resume".
BENCH_MODE ?= quick
bench: venv artifacts
	$(PY) -m bench --mode $(BENCH_MODE) $(BENCH_ARGS)

lint: venv
	$(PY) -m ruff check src tests bench
	$(PY) -m ruff format --check src tests bench

clean-venv:
	rm -rf $(VENV)
