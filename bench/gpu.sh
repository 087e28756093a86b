#!/usr/bin/env bash
# Experiment-throughput benchmark on one CUDA GPU (issue 7), one prepared script.
#
#   bash bench/gpu.sh [OUT_DIR]        (default out/bench-gpu; PYTHON=... to pick the interpreter)
#
# Builds a random ~0.5B-parameter Llama (no downloads), measures the device's bf16 matmul
# rate, runs the three arms (sequential cold, hot time-sliced, hot fused; N=1 and 8; 10-step
# experiments; one repeat after a warm-up) with the frozen base in bf16 under autocast, and
# reports training tokens/s and the FLOP floor (4P + 6P_L)·T as a share of the measured
# rate: OUT_DIR/gpu_results.json, results.json, throughput.png, rewards.png.
# Needs a CUDA build of torch with transformers and loraplex-engine importable
# (e.g. `make venv` on a CUDA machine with a CUDA torch pinned). Sized for a 10-minute
# device slot (estimate ~6-7 min on one H200, most of it the 9 sequential cold starts of a
# 2 GB fp32 checkpoint); BENCH_GPU_ARGS widens it on a machine you own, e.g.
# BENCH_GPU_ARGS="--ns 1,2,4,8 --repeats 3". Not run yet: no GPU was lent to issue 7.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-out/bench-gpu}"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"

"$PY" - <<'PYEOF'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"bench/gpu.sh: no CUDA device visible to torch {torch.__version__}")
import transformers, loraplex_engine  # noqa: F401  (fail early, before building a model)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
PYEOF

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null || true
mkdir -p "$OUT_DIR"
# shellcheck disable=SC2086
"$PY" bench/gpu_bench.py --out "$OUT_DIR" ${BENCH_GPU_ARGS:-} 2>&1 | tee "$OUT_DIR/log.txt"
