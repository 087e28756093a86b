#!/usr/bin/env bash
# The GPU check (issue 12), one prepared script for a 10-minute device slot.
#
#   bash bench/gpu.sh [OUT.json]                  (default bench/results/gpu-<device>-<date>.json)
#   bash bench/gpu.sh --dry-run OUT.json          (the same code on the CPU, tiny, < 1 min)
#   bash bench/gpu.sh --throughput [OUT_DIR]      (issue 7's three-arm throughput run instead)
#
# Default (bench/gpu_scale.py): a random-weight model with Qwen3-4B's shapes
# (bench/configs/qwen3-4b.json) built on the GPU, N = 1, 8, 32 adapters at rank 32 on
# every linear, base in bf16, LoRA + Adam fp32, chunked log-probs and gradient
# checkpointing; per N the fused and time-sliced training steps (and one-at-a-time as N x
# the N=1 step): seconds, tokens/s, the FLOP floor as a share of the measured bf16 rate,
# and torch.cuda.max_memory_allocated against the memory planner's prediction for the
# same workload (planned on the host's CPUs meanwhile). Cells past --budget-s (540 s)
# are skipped and the JSON is written after every cell. BENCH_GPU_ARGS passes options,
# e.g. BENCH_GPU_ARGS="--layers 18" if the full 36 layers do not fit the slot.
#
# --throughput (bench/gpu_bench.py): a random ~0.5B Llama through bench/throughput.py's
# sequential-cold / hot time-sliced / hot fused arms (N=1, 8), writing OUT_DIR.
#
# Needs only a CUDA build of torch with transformers, peft and safetensors: the engine
# package is used from this checkout (PYTHONPATH=trainer-image, inherited by the bench's
# worker processes), and the few other modules it imports (pydantic for experiment
# specs, httpx for reward functions) are pip-installed at the pins of
# requirements/constraints.txt when missing. The device machine has no network: carry a
# wheel directory and set PIP_FIND_LINKS=DIR PIP_NO_INDEX=1 if they may be missing there.
# Not run on a GPU yet: none was lent to issues 7 and 12.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=""
THROUGHPUT=""
while [[ "${1:-}" == --* ]]; do
    case "$1" in
    --dry-run) DRY_RUN="--dry-run" ;;
    --throughput) THROUGHPUT=1 ;;
    *) echo "bench/gpu.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
OUT="${1:-}"
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
import loraplex_engine.engine, loraplex_engine.planner, loraplex_engine.tiny_model  # noqa: F401,E401
device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {device}, "
      f"transformers {transformers.__version__}, peft {peft.__version__}")
PYEOF

[[ -n "$DRY_RUN" ]] || nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null || true
if [[ -n "$THROUGHPUT" ]]; then
    OUT_DIR="${OUT:-out/bench-gpu}"
    mkdir -p "$OUT_DIR"
    # shellcheck disable=SC2086
    "$PY" bench/gpu_bench.py --out "$OUT_DIR" $DRY_RUN ${BENCH_GPU_ARGS:-} 2>&1 | tee "$OUT_DIR/log.txt"
else
    # shellcheck disable=SC2086
    "$PY" bench/gpu_scale.py ${OUT:+--out "$OUT"} $DRY_RUN ${BENCH_GPU_ARGS:-}
fi
