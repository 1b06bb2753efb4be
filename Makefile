PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench probe chaos clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/iop demo $(if $(BIND),--bind $(BIND))

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python scripts/bench.py

probe: $(STAMP)
	$(BIN)/python scripts/cancel_probe.py

chaos: $(STAMP)
	$(BIN)/python scripts/chaos.py

clean:
	rm -rf $(VENV) build *.egg-info
