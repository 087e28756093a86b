#!/usr/bin/env bash
# The GPU check (issues 12, 13, 17), one prepared script for a 10-minute device slot.
#
# For a machine with network access (it pip-installs what is missing), vLLM and two GPUs.
# The lent device machines have none of these: there, run bench/gpu_device.sh (issue 27).
#
#   bash bench/gpu.sh [OUT.json]                  (default bench/results/gpu-<device>-<date>.json)
#   bash bench/gpu.sh --dry-run OUT.json          (the same code on the CPU, tiny, 1-3 min)
#   bash bench/gpu.sh --throughput [OUT_DIR]      (issue 7's three-arm throughput run instead)
#
# Default (bench/gpu_check.py): three arms, each its own process, one after another
# within one 570 s budget from the script's start (GPU_CHECK_BUDGET_S), into one JSON with a section per arm
# (arms.scale, arms.vllm, arms.dp), rewritten every few seconds; OUT's .log beside it:
#
# - scale (bench/gpu_scale.py): a random-weight model with Qwen3-4B's shapes
#   (bench/configs/qwen3-4b.json) built on the GPU, N = 1, 8, 32 adapters at rank 32 on
#   every linear, base in bf16, LoRA + Adam fp32, chunked log-probs and gradient
#   checkpointing; per N the fused and time-sliced training steps (and one-at-a-time as
#   N x the N=1 step): seconds, tokens/s, the FLOP floor as a share of the measured bf16
#   rate, and torch.cuda.max_memory_allocated against the memory planner's prediction.
#   BENCH_GPU_ARGS passes it options, e.g. BENCH_GPU_ARGS="--layers 18".
# - vllm (bench/gpu_vllm.py): the engine with the vLLM rollout backend in bf16 on a
#   random Qwen3-0.6B-shaped model, the demo-like target-token workload: co-located with
#   sleep mode, and on cuda:1 where there is a second GPU. Rollout tokens/s, sleep and
#   wake-up seconds, sync seconds, the off-policy gap, peak memory (trainer and every GPU).
#   Skipped, saying so, where no python imports vllm (LORAPLEX_VLLM_PYTHON, else this one).
# - dp (bench/gpu_dp.py): loraplex-engine run --world-size 1 vs 2 (and --shard-base
#   where run has it) on the same rows: training tokens/s, adapters equal within a stated
#   tolerance. Skipped, saying so, on one GPU or where run has no --device.
#
# An arm past its share of the budget is killed and what it wrote is kept; cells past
# an arm's own budget are recorded as skipped. The whole run ends within the budget.
#
# Needs only a CUDA build of torch with transformers, peft and safetensors (and vLLM for
# its arm): the engine package is used from this checkout (PYTHONPATH=trainer-image,
# inherited by the bench's worker processes), and the few other modules it imports
# (pydantic for experiment specs, httpx for reward functions, pyyaml, psutil; matplotlib
# for the world-size arm) are pip-installed at the pins of requirements/constraints.txt
# when missing. The device machine has no
# network: carry a wheel directory and set PIP_FIND_LINKS=DIR PIP_NO_INDEX=1 if they may
# be missing there. Not run on a GPU yet: none was lent to issues 7, 12, 13 and 17.
set -euo pipefail
STARTED=$SECONDS  # the budget counts from here, the checks and installs below included
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
# distribution that provides each (pinned by requirements/constraints.txt). Required:
# every arm imports the engine. Optional: matplotlib, which only `loraplex-engine run`
# needs (its rewards.png); without it the world-size arm is skipped, saying so.
missing_dists() {
    "$PY" - "$1" <<'PYEOF'
import importlib.util, sys
wanted = {
    "required": (("pydantic", "pydantic"), ("httpx", "httpx"), ("yaml", "pyyaml"),
                 ("psutil", "psutil")),
    "optional": (("matplotlib", "matplotlib"),),
}[sys.argv[1]]
for module, dist in wanted:
    if importlib.util.find_spec(module) is None:
        print(dist)
PYEOF
}
missing="$(missing_dists required | tr '\n' ' ')"
if [[ -n "${missing// /}" ]]; then
    echo "bench/gpu.sh: installing missing $missing(pinned by requirements/constraints.txt)"
    # shellcheck disable=SC2086
    "$PY" -m pip install -q -c requirements/constraints.txt $missing || {
        echo "bench/gpu.sh: could not install $missing; install them (see the header)" >&2
        exit 1
    }
fi
optional="$(missing_dists optional | tr '\n' ' ')"
if [[ -n "${optional// /}" ]]; then
    # shellcheck disable=SC2086
    timeout 60 "$PY" -m pip install -q -c requirements/constraints.txt $optional ||
        echo "bench/gpu.sh: could not install $optional; the arms that need it are skipped"
fi

DRY_RUN="$DRY_RUN" "$PY" - <<'PYEOF'
import os
import sys
import torch
if not os.environ["DRY_RUN"] and not torch.cuda.is_available():
    sys.exit(f"bench/gpu.sh: no CUDA device visible to torch {torch.__version__}")
# Fail early, before building a model: what the bench and its workers import.
import transformers, peft, safetensors  # noqa: F401,E401
import loraplex_engine.engine, loraplex_engine.memory.planner, loraplex_engine.dev.tiny_model  # noqa: F401,E401
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
    if [[ -z "$OUT" ]]; then
        SLUG=dry-run
        [[ -n "$DRY_RUN" ]] || SLUG="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null |
            head -1 | awk '{print tolower($NF)}')"
        OUT="bench/results/gpu-${SLUG:-cuda}-$(date -u +%Y%m%d-%H%M).json"
    fi
    mkdir -p "$(dirname "$OUT")"
    BUDGET=$(( ${GPU_CHECK_BUDGET_S:-570} - (SECONDS - STARTED) ))
    # shellcheck disable=SC2086
    "$PY" bench/gpu_check.py --out "$OUT" --budget-s "$BUDGET" $DRY_RUN ${BENCH_GPU_ARGS:-} \
        2>&1 | tee "${OUT%.json}.log"
fi
