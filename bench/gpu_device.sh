#!/usr/bin/env bash
# The GPU check in one `device` call, on a bare, offline lent machine (issue 27).
#
#   here, once:   bash scripts/gpu-wheelhouse.sh        (.whl: pydantic, the server, the
#                                                       tinker SDK and their needs)
#   the call:     device run  command "bash bench/gpu_device.sh"  carry [".whl"]  timeout_s 540
#   rehearsal:    OUT=DIR bash bench/gpu_device.sh --dry-run   (CPU, tiny; tests/bench/test_gpu_device.py)
#
# Stages, one after another, each under its own limit (`timeout`: a stage past it is
# killed with its children), each writing its file to $OUT as soon as it has one (only
# $OUT comes back, at most 8 files):
#
#   preflight.json       versions and the one line naming what is missing (printed before
#                        anything can fail), nvidia-smi, the carried wheels installed with
#                        pip --target into $SITE (on PYTHONPATH), the engine imported    <= 60 s
#   grouped-kernel.json  torch._grouped_mm's CUTLASS kernel vs bmm at Qwen3-4B's projections,
#                        N=32 rank 32: if it fails or disagrees, the scale cells take bmm <= 60 s
#   (workloads)          bench/fused_workloads.py --device cuda: fused vs time-sliced on SkyRL
#                        #1938's underfilled and saturated workloads (issue 32), N=8, into
#                        grouped-kernel.json's "fused_workloads" (8 files at most)  <= 60 s
#   scale.json           bench/gpu_scale.py: Qwen3-4B's shapes, random weights from the config,
#                        N = 1, 8, 32: fused vs time-sliced vs one-at-a-time, tokens/s, peak
#                        memory vs the planner; a failing arm or cell is recorded, the next
#                        runs; saved after every arm                 what is left - 120 - 110 s
#   e2e.json             python -m loraplex_engine.cli run --device cuda of samples/local/demo.yaml,
#                        fused then time-sliced, reward parity (+ e2e-rewards.png)    <= 120 s
#   (torch-pipelined)    bench/gpu_pipelined.py: the pipelined schedule vs sync with the torch
#                        rollout (its side CUDA stream beside training, issue 32), N=8, timed,
#                        reward and weight parity, into e2e.json's "torch_pipelined"   <= 60 s
#   (paging)             bench/paging.py --device cuda: 1,000 client models on 8 slots of the
#                        tiny model, host-memory and spilled arms, a working set of 8: page-in
#                        latency per tier with pinned copies, steps/s, prefetch hits and
#                        hidden copies (4 models a tick), into e2e.json's
#                        "paging" (docs/design/paging.md)                               <= 45 s
#   tinker-clock.json    bench/gpu_tinker.py: bench/tinker_clock.py's 8 tinker SDK clients,
#                        fused clock cycle vs per_model, on the CPU tiny model with the
#                        clients on other cores than the engine, then on serve --device
#                        cuda with Qwen3-0.6B's shapes; ratio per N, parity   <= 110 s, last
#   stages.json          each stage's exit code, seconds and limit; the vLLM, vLLM-pipelined
#                        and world-size arms, skipped with the reason (this image has no vLLM; one GPU)
#   gpu-device.log       everything printed
#
# All within GPU_DEVICE_BUDGET_S (510 s from the start; ~5 min expected): with the kill
# grace, under the call's 540 s. Exit code: 0 when every stage exited 0.
# Environment: OUT (default out/gpu-device), PYTHON (python3), WHEELS (.whl), SITE
# (/tmp/site), GPU_DEVICE_DEMO (the manifest), GPU_DEVICE_WORK (/tmp/gpu-device-e2e: the
# e2e's model and runs), GPU_DEVICE_TINKER_S (110: the tinker-clock stage's cap, reserved
# from the scale stage's share), GPU_DEVICE_TINKER_WORK (/tmp/gpu-device-tinker),
# GPU_SCALE_ARGS (more gpu_scale.py options), GPU_DEVICE_PIPELINED_S (60: the
# torch-pipelined stage's cap, reserved from the scale stage's share), GPU_DEVICE_PAGING_S
# (45: the paging stage's cap, reserved from the scale stage's share too),
# GPU_DEVICE_SLOWDOWN_PCT (100: every limit and the budget times this / 100; the CPU
# rehearsal sets it from its machine's load, tests/bench/test_gpu_device.py).
set -uo pipefail  # not -e: a stage that fails is recorded and the next still runs
START=$SECONDS
cd "$(dirname "$0")/.."
DRY_RUN=""
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1
OUT="${OUT:-out/gpu-device}"
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-.whl}"
SITE="${SITE:-/tmp/site}"
SLOWDOWN="${GPU_DEVICE_SLOWDOWN_PCT:-100}"
slow() { echo $(($1 * SLOWDOWN / 100)); }  # seconds of an idle device, on this machine now
BUDGET=$(slow "${GPU_DEVICE_BUDGET_S:-510}")
DEMO="${GPU_DEVICE_DEMO:-samples/local/demo.yaml}"
WORK="${GPU_DEVICE_WORK:-/tmp/gpu-device-e2e}"  # the e2e's model and runs: many files, not $OUT
E2E_S=$(slow 120)
TINKER_S=$(slow "${GPU_DEVICE_TINKER_S:-110}")  # reserved from the scale stage's share, like E2E_S
TINKER_WORK="${GPU_DEVICE_TINKER_WORK:-/tmp/gpu-device-tinker}"
WORKLOADS_S=$(slow 60)
PIPELINED_S=$(slow "${GPU_DEVICE_PIPELINED_S:-60}")  # reserved from the scale stage's share
PAGING_S=$(slow "${GPU_DEVICE_PAGING_S:-45}")  # reserved from the scale stage's share
mkdir -p "$OUT" "$SITE"
OUT="$(cd "$OUT" && pwd)"
# The wheels first: they bring a newer typing_extensions than the image's.
export PYTHONPATH="$SITE:$PWD/trainer-image${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
FAILED=0

# stage NAME FILE CAP CMD...: run CMD under min(CAP, what is left of the budget), then
# record its ending (and a file saying why, if it wrote none).
stage() {
    local name=$1 file=$2 cap=$3 left limit t0 rc
    shift 3
    left=$((BUDGET - (SECONDS - START)))
    limit=$((cap < left ? cap : left))
    t0=$SECONDS
    if ((limit < 5)); then
        echo "== $name: not started, ${left}s of the budget left"
        rc=-1
    else
        echo "== $name (limit ${limit}s, $((SECONDS - START))s in)"
        timeout -k 5 "$limit" "$@"
        rc=$?
    fi
    ((rc == 0)) || FAILED=1
    "$PY" bench/gpu_device.py record --out "$OUT" --stage "$name" --file "$file" \
        --rc="$rc" --wall-s "$((SECONDS - t0))" --limit-s "$limit"
    echo "== $name: exit $rc in $((SECONDS - t0))s"
}

# The lora kernel the scale cells take: the check's verdict, bmm without one.
scale_kernel() {
    "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("scale_lora_kernel", "bmm"))' \
        "$OUT/grouped-kernel.json" 2>/dev/null || echo bmm
}

# Issue 28's Tinker clock cycle, last: the stages above keep their results whatever
# happens here. One file back (tinker-clock.json); its own work folder.
tinker_clock_stage() {
    local left budget
    left=$((BUDGET - (SECONDS - START)))
    budget=$(((left < TINKER_S ? left : TINKER_S) - 5))
    stage tinker-clock tinker-clock.json "$TINKER_S" \
        "$PY" bench/gpu_tinker.py --out "$OUT/tinker-clock.json" --budget-s "$budget" \
        --work "$TINKER_WORK" ${DRY_RUN:+--dry-run}
}

main() {
    echo "bench/gpu_device.sh${DRY_RUN:+ (dry run)}: $(date -u +%FT%TZ), OUT=$OUT, budget ${BUDGET}s"
    "$PY" bench/gpu_device.py begin --out "$OUT"
    stage preflight preflight.json "$(slow 60)" \
        "$PY" bench/gpu_device.py preflight --out "$OUT" --wheels "$WHEELS" --site "$SITE"
    stage grouped-kernel grouped-kernel.json "$(slow 60)" \
        "$PY" bench/gpu_device.py kernel --out "$OUT/grouped-kernel.json" ${DRY_RUN:+--dry-run}
    stage workloads grouped-kernel.json "$WORKLOADS_S" \
        "$PY" bench/fused_workloads.py --out "$OUT/grouped-kernel.json" --into fused_workloads \
        --device "$([[ -n "$DRY_RUN" ]] && echo cpu || echo cuda)" \
        ${DRY_RUN:+--preset tiny --n 2 --seq 16 --saturated-rows 2 --steps 3}
    local kernel left scale_s
    kernel=$(scale_kernel)
    echo "scale cells: --lora-kernel $kernel"
    left=$((BUDGET - (SECONDS - START)))
    scale_s=$((left - E2E_S - PIPELINED_S - PAGING_S - TINKER_S))
    # shellcheck disable=SC2086  # GPU_SCALE_ARGS: options, split on purpose
    stage scale scale.json "$scale_s" \
        "$PY" bench/gpu_scale.py --out "$OUT/scale.json" --budget-s "$((scale_s * 8 / 10))" \
        --lora-kernel "$kernel" --no-grouped-arm ${DRY_RUN:+--dry-run} ${GPU_SCALE_ARGS:-}
    left=$((BUDGET - (SECONDS - START)))
    stage e2e e2e.json "$E2E_S" \
        "$PY" bench/gpu_e2e.py --out "$OUT/e2e.json" --manifest "$DEMO" \
        --device "$([[ -n "$DRY_RUN" ]] && echo cpu || echo cuda)" --work "$WORK" \
        --budget-s "$(((left < E2E_S ? left : E2E_S) - 5))" --png "$OUT/e2e-rewards.png"
    left=$((BUDGET - (SECONDS - START)))
    stage torch-pipelined e2e.json "$PIPELINED_S" \
        "$PY" bench/gpu_pipelined.py --out "$OUT/e2e.json" --into torch_pipelined \
        --device "$([[ -n "$DRY_RUN" ]] && echo cpu || echo cuda)" \
        --budget-s "$(((left < PIPELINED_S ? left : PIPELINED_S) - 10))" \
        ${DRY_RUN:+--preset tiny --n 2 --steps 3 --rounds 1}
    # Half the slots a tick: the models still queued are prefetched under its compute.
    local paging_size=(--models 1000 --slots 8 --models-per-tick 4 --rounds 33 --spill-budget 16MiB)
    [[ -n "$DRY_RUN" ]] && paging_size=(--models 40 --slots 4 --models-per-tick 2 --rounds 5 --warmup 1 --spill-budget 2MiB)
    left=$((BUDGET - (SECONDS - START)))
    # The arms share what is left after ~15 s of imports and the tiny model's build.
    stage paging e2e.json "$PAGING_S" \
        "$PY" bench/paging.py --out "$OUT/e2e.json" --into paging \
        --device "$([[ -n "$DRY_RUN" ]] && echo cpu || echo cuda)" \
        --budget-s "$(((left < PAGING_S ? left : PAGING_S) - 15))" \
        --arms paged,spilled --working-sets 8 "${paging_size[@]}"
    tinker_clock_stage
    echo "bench/gpu_device.sh: done in $((SECONDS - START))s; $OUT: $(ls "$OUT" | tr '\n' ' ')"
    return "$FAILED"
}

main 2>&1 | tee -a "$OUT/gpu-device.log"
exit "${PIPESTATUS[0]}"
