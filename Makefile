# loraplex — every target installs what it needs itself (.venv, tools under .tools/).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TINY_MODEL := .cache/models/tiny-llama
export PYTHONUNBUFFERED := 1

.PHONY: all venv vllm-venv tiny-model test lint fmt demo bench bench-quick chart images e2e clean

all: test

venv: $(STAMP)

# Pinned installs: direct pins in requirements/*.txt, the full set in constraints.txt.
$(STAMP): requirements/*.txt trainer-image/pyproject.toml operator/pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c requirements/constraints.txt \
		-r requirements/dev.txt -e ./trainer-image -e ./operator
	@touch $@

# vLLM for CPU in its own venv (.venv-vllm): see scripts/install-vllm.sh. Idempotent; ~4 min
# and ~2.5 GB the first time, instant after. The vllm rollout backend's tests need it.
vllm-venv:
	./scripts/install-vllm.sh

tiny-model: $(TINY_MODEL)/config.json

$(TINY_MODEL)/config.json: $(STAMP)
	$(VENV)/bin/loraplex-engine tiny-model --out $(TINY_MODEL)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

fmt: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: lint tiny-model vllm-venv
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .venv-vllm .cache out .tools
