# loraplex — every target installs what it needs itself (.venv, tools under .tools/).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TINY_MODEL := .cache/models/tiny-llama
export PYTHONUNBUFFERED := 1

.PHONY: all venv tiny-model test lint fmt demo bench bench-quick chart images e2e clean

all: test

venv: $(STAMP)

# Pinned installs: direct pins in requirements/*.txt, the full set in constraints.txt.
$(STAMP): requirements/*.txt trainer-image/pyproject.toml operator/pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c requirements/constraints.txt \
		-r requirements/dev.txt -e ./trainer-image -e ./operator
	@touch $@

tiny-model: $(TINY_MODEL)/config.json

$(TINY_MODEL)/config.json: $(STAMP)
	$(VENV)/bin/loraplex-engine tiny-model --out $(TINY_MODEL)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

fmt: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: lint tiny-model
	$(PY) -m pytest -q

# The operator scenarios (tests/operator/test_operator_e2e.py) against a real cluster: needs
# KUBECONFIG, the CRDs installed, LORAPLEX_E2E_IMAGE (an engine image holding the model at
# LORAPLEX_E2E_MODEL, default /models/tiny-llama), and pod IPs reachable from here (the
# operator runs locally, as in `make test` where the API server is kmock).
e2e: $(STAMP) tiny-model
	@test -n "$$KUBECONFIG" || { echo "make e2e: set KUBECONFIG to a real cluster (see Makefile)"; exit 2; }
	LORAPLEX_E2E=1 $(PY) -m pytest -q tests/operator/test_operator_e2e.py

clean:
	rm -rf $(VENV) .cache out .tools
