#!/usr/bin/env bash
# Experiment-throughput benchmark on one CUDA GPU (issue 7), one prepared script.
#
#   bash bench/gpu.sh [OUT_DIR]             (default out/bench-gpu; PYTHON=... picks python)
#   bash bench/gpu.sh --dry-run [OUT_DIR]   (the same pipeline on the CPU, tiny, ~1 min)
#
# Builds a random ~0.5B-parameter Llama (no downloads), measures the device's bf16 matmul
# rate, runs the three arms (sequential cold, hot time-sliced, hot fused; N=1 and 8; 10-step
# experiments; one repeat after a warm-up) with the frozen base in bf16 under autocast, and
# reports training tokens/s and the FLOP floor (4P + 6P_L)·T as a share of the measured
# rate: OUT_DIR/gpu_results.json, results.json, throughput.png, rewards.png.
#
# Needs only a CUDA build of torch with transformers, peft and safetensors: the engine
# package is used from this checkout (PYTHONPATH=trainer-image, inherited by the bench's
# worker processes), and the few other modules it imports (pydantic for experiment
# specs, httpx for reward functions) are pip-installed at the pins of
# requirements/constraints.txt when missing. The device machine has no network: carry a
# wheel directory and set PIP_FIND_LINKS=DIR PIP_NO_INDEX=1 if they may be missing there.
# matplotlib is optional (no plots without it).
#
# Sized for a 10-minute device slot (estimate ~6-7 min on one H200, most of it the 9
# sequential cold starts, each loading the ~1 GB bf16 checkpoint); BENCH_GPU_ARGS widens
# it on a machine you own, e.g. BENCH_GPU_ARGS="--ns 1,2,4,8 --repeats 3". Not run yet:
# no GPU was lent to issue 7.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=""
if [[ "${1:-}" == "--dry-run" ]]; then
    DRY_RUN="--dry-run"
    shift
fi
OUT_DIR="${1:-out/bench-gpu}"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
export PYTHONPATH="$PWD/trainer-image${PYTHONPATH:+:$PYTHONPATH}"

# Modules the engine imports beyond torch/transformers/peft/safetensors, with the
# distribution that provides each (pinned by requirements/constraints.txt).
missing_dists() {
    "$PY" - <<'PYEOF'
import importlib.util
for module, dist in (("pydantic", "pydantic"), ("httpx", "httpx"), ("yaml", "pyyaml")):
    if importlib.util.find_spec(module) is None:
        print(dist)
PYEOF
}
missing="$(missing_dists | tr '\n' ' ')"
if [[ -n "${missing// /}" ]]; then
    echo "bench/gpu.sh: installing missing $missing(pinned by requirements/constraints.txt)"
    # shellcheck disable=SC2086
    "$PY" -m pip install -q -c requirements/constraints.txt $missing || {
        echo "bench/gpu.sh: could not install $missing; install them (see the header)" >&2
        exit 1
    }
fi

DRY_RUN="$DRY_RUN" "$PY" - <<'PYEOF'
import os
import sys
import torch
if not os.environ["DRY_RUN"] and not torch.cuda.is_available():
    sys.exit(f"bench/gpu.sh: no CUDA device visible to torch {torch.__version__}")
# Fail early, before building a model: what the bench and its workers import.
import transformers, peft, safetensors  # noqa: F401,E401
import loraplex_engine.engine, loraplex_engine.spec, loraplex_engine.tiny_model  # noqa: F401,E401
device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {device}, "
      f"transformers {transformers.__version__}, peft {peft.__version__}")
PYEOF

[[ -n "$DRY_RUN" ]] || nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null || true
mkdir -p "$OUT_DIR"
# shellcheck disable=SC2086
"$PY" bench/gpu_bench.py --out "$OUT_DIR" $DRY_RUN ${BENCH_GPU_ARGS:-} 2>&1 | tee "$OUT_DIR/log.txt"
