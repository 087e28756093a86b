"""The GPU check's data-parallel arm (issue 17): ``loraplex-engine run --world-size N``.

    python bench/gpu_dp.py --out OUT.json [--budget-s S]   (bench/gpu_check.py runs it)
    python bench/gpu_dp.py --dry-run --out OUT.json        (gloo, 2 CPU ranks, tiny)

The real command line, one process per rank (parallel/launch.py starts them), on the same
random-weight Qwen3-0.6B-shaped model as the vLLM arm and the same demo-like
target-token experiments (bench/gpu_common.py), bf16 base, fused training:

- ``world_size_1``: one rank;
- ``world_size_2``: two ranks (NCCL on two GPUs; gloo on the CPU), rank 0 rolls out and
  every rank trains its share of the tick's rows;
- ``world_size_2_sharded``: the same with ``--shard-base`` (the base sharded over the
  ranks), where ``loraplex-engine run --help`` lists that flag.

Each run is seeded the same, so every world size trains the same rows (the reward curves
say whether it did). Per run: the training tokens (the engine's own count, from each
experiment's last checkpoint), the train phase's seconds, training tokens/s, wall
seconds and, on a GPU, every GPU's peak used memory. Against world size 1: the speed-up
of the train phase, whether the reward curves are equal, the largest |adapter weight
difference|, and the relative difference of the trained ``lora_B`` weights against a
stated tolerance (``TOLERANCE``).

On a GPU it needs two GPUs and a ``loraplex-engine run`` that takes ``--device`` (it
passes ``--device cuda``: rank r on ``cuda:<LOCAL_RANK>``, NCCL; an older ``run`` without
the flag trained on the CPU whatever the machine had); without either the arm is skipped
with the reason. The JSON is written after every run; a run that would start past
``--budget-s`` is recorded as skipped, one still running at it is killed and recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import (
    DRY_RUN_WORKLOAD,
    FAMILY_MODEL_DIRS,
    GPU_WORKLOAD,
    Budget,
    DeviceMemoryPoller,
    Workload,
    arm_skipped,
    build_family_model,
    cell_skipped,
    demo_specs,
    error_text,
    gpu_count,
    has_flag,
    run_in_group,
    write_json,
)

# Largest |lora_B(DP=2) - lora_B(DP=1)| / |lora_B(DP=1)| (L2, over every experiment)
# that counts as the same adapters (adapter_diff). Measured on the dry run (tiny model,
# 2 steps, 2 gloo ranks): 2.5e-7 in float32, 3.0e-2 in bfloat16, where each rank rounds
# its own micro-batches' activations and Adam's first steps turn a flipped sign of a
# near-zero gradient into a full ±lr; a wrong gradient (a rank's rows lost or counted
# twice) moves a large share of the update.
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1}
RUN_MIN_S = 60.0  # a GPU run: two ranks load the model, 3 ticks
DRY_RUN_RUN_MIN_S = 15.0
CLI = [sys.executable, "-m", "loraplex_engine.cli", "run"]


def run_flags() -> str:
    """``loraplex-engine run --help``: which flags this checkout's engine has."""
    proc = subprocess.run([*CLI, "--help"], capture_output=True, text=True, timeout=120)
    return proc.stdout


def why_skip(dry_run: bool, help_text: str | None = None) -> str | None:
    """Why this arm cannot run here (None: it can)."""
    if importlib.util.find_spec("matplotlib") is None:
        return "no matplotlib: `loraplex-engine run` plots its rewards.png with it"
    if dry_run:
        return None
    gpus = gpu_count()
    if gpus < 2:
        return f"world size 2 needs two GPUs (torch sees {gpus})"
    if not has_flag(help_text if help_text is not None else run_flags(), "--device"):
        return "`loraplex-engine run` has no --device: its ranks would train on the CPU"
    return None


def cells(help_text: str) -> list[tuple[str, list[str], str | None]]:
    """``(cell, extra flags, why skipped or None)``."""
    shard = None if has_flag(help_text, "--shard-base") else "`run --help` lists no --shard-base"
    return [
        ("world_size_1", ["--world-size", "1"], None),
        ("world_size_2", ["--world-size", "2"], None),
        ("world_size_2_sharded", ["--world-size", "2", "--shard-base"], shard),
    ]


def manifest(w: Workload) -> str:
    """The workload as LoRAExperiment manifests for ``loraplex-engine run``."""
    docs = []
    for exp in demo_specs(w):
        name = exp["id"].split(".", 1)[1]
        spec = {"enginePool": "local", **exp["spec"]}
        doc = {"apiVersion": "loraplex.dev/v1alpha1", "kind": "LoRAExperiment",
               "metadata": {"name": name}, "spec": spec}  # fmt: skip
        docs.append(json.dumps(doc))  # JSON is YAML: one document each
    return "\n---\n".join(docs) + "\n"


def train_tokens(out_dir: Path) -> int:
    """Training tokens of every experiment, from each one's newest checkpoint (the
    engine's own count: ``trainTokens`` in trainer_state.json)."""
    newest: dict[Path, Path] = {}
    for state in (out_dir / "checkpoints").rglob("trainer_state.json"):
        run = state.parent.parent
        if run not in newest or state.parent.name > newest[run].parent.name:
            newest[run] = state
    return sum(json.loads(p.read_text())["metadata"]["trainTokens"] for p in newest.values())


def measured(out_dir: Path, wall_s: float, peaks: dict[str, int] | None) -> dict[str, Any]:
    summary = json.loads((out_dir / "summary.json").read_text())
    tokens = train_tokens(out_dir)
    train_s = summary["phase_seconds"].get("train", 0.0)
    return {
        "wall_s": wall_s,
        "engine_wall_s": summary["wall_seconds"],
        "phase_s": summary["phase_seconds"],
        "train_tokens": tokens,
        "train_s": train_s,
        "train_tokens_per_s": tokens / train_s if train_s else None,
        "rewards": {e["name"]: e["rewards"] for e in summary["experiments"]},
        "phases": {e["name"]: e["phase"] for e in summary["experiments"]},
        "device_peak_bytes": peaks,
    }


def adapter_diff(a_dir: Path, b_dir: Path) -> dict[str, float]:
    """How far ``b_dir``'s adapters are from ``a_dir``'s: the largest |a - b| over every
    weight, and |b - a| / |a| (L2) over the ``lora_B`` weights, which start at zero, so
    that ``a`` is the training's whole update and the ratio says what share of it differs
    (rounding flips the sign of Adam's first steps on near-zero gradients, ±lr each; a
    wrong gradient moves most of the update)."""
    from safetensors.torch import load_file

    worst, diff_sq, norm_sq = 0.0, 0.0, 0.0
    for a_file in sorted((a_dir / "adapters").glob("*/adapter_model.safetensors")):
        a = load_file(a_file)
        b = load_file(b_dir / "adapters" / a_file.parent.name / a_file.name)
        if a.keys() != b.keys():
            raise ValueError(f"{a_file.parent.name}: the adapters hold different tensors")
        for k in a:
            d = b[k].double() - a[k].double()
            worst = max(worst, float(d.abs().max()))
            if "lora_B" in k:
                diff_sq += float(d.square().sum())
                norm_sq += float(a[k].double().square().sum())
    return {"max_abs": worst, "lora_b_relative": (diff_sq / norm_sq) ** 0.5 if norm_sq else None}


def compare(base: dict[str, Any], run: dict[str, Any], dtype: str) -> dict[str, Any]:
    """``run`` against world size 1 on the same rows."""
    diff = adapter_diff(Path(base["out"]), Path(run["out"]))
    speedup = base["train_s"] / run["train_s"] if run["train_s"] else None
    rel = diff["lora_b_relative"]
    return {
        "same_rewards": run["rewards"] == base["rewards"],
        "adapter_max_abs_diff": diff["max_abs"],
        "adapter_lora_b_relative_diff": rel,
        "tolerance": TOLERANCE[dtype],
        "adapters_equal": rel is not None and rel <= TOLERANCE[dtype],
        "train_speedup_over_world_size_1": speedup,
    }


def run_one(flags: list[str], model_dir: Path, manifest_path: Path, out_dir: Path,
            common: list[str], budget: Budget, dry_run: bool) -> dict[str, Any]:  # fmt: skip
    cmd = [*CLI, str(manifest_path), "--model", str(model_dir), "--out", str(out_dir),
           *common, *flags]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if dry_run else None  # 2 ranks, 2 cores
    started = time.monotonic()
    with DeviceMemoryPoller() as poller:
        code = run_in_group(cmd, budget.left(), env=env)
    wall = time.monotonic() - started
    if code != 0:
        why = "killed at the time budget" if code is None else f"exited with code {code}"
        return {"command": cmd, "error": f"loraplex-engine run {why}", "wall_s": wall}
    return {"command": cmd, "out": str(out_dir)} | measured(out_dir, wall, poller.peaks())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget-s", type=float, default=200.0)
    p.add_argument("--dry-run", action="store_true", help="gloo, 2 CPU ranks, tiny model")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(TOLERANCE))
    p.add_argument("--model-dir", type=Path, help="default .cache/models/gpu-qwen3-*")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    budget = Budget.of(args.budget_s)
    w = DRY_RUN_WORKLOAD if args.dry_run else dataclasses.replace(GPU_WORKLOAD, steps=3)
    dtype = args.dtype
    result: dict[str, Any] = {"arm": "dp", "dry_run": args.dry_run, "workload": vars(w),
                              "dtype": dtype, "cells": [], "skipped": []}  # fmt: skip
    help_text = run_flags()
    if arm_skipped(result, args.out, "data-parallel", why_skip(args.dry_run, help_text)):
        return result
    device = "cpu" if args.dry_run else "cuda"
    model_dir = args.model_dir or FAMILY_MODEL_DIRS[args.dry_run]  # built at the first run
    common = ["--dtype", dtype, "--max-adapters", str(w.experiments), "--max-rank", str(w.rank)]
    if has_flag(help_text, "--device"):
        common += ["--device", device]
    need = DRY_RUN_RUN_MIN_S if args.dry_run else RUN_MIN_S
    with tempfile.TemporaryDirectory(prefix="gpu-dp-") as tmp:
        manifest_path = Path(tmp) / "experiments.yaml"
        manifest_path.write_text(manifest(w))
        base: dict[str, Any] | None = None
        for name, flags, skip in cells(help_text):
            if cell_skipped(result, args.out, "data parallel", name, skip, budget, need):
                continue
            print(f"data parallel {name}: loraplex-engine run {' '.join(flags)}", flush=True)
            try:
                build_family_model(model_dir, args.dry_run, device)
                run = run_one(flags, model_dir, manifest_path, Path(tmp) / name, common,
                              budget, args.dry_run)  # fmt: skip
                if base is None and "error" not in run:
                    base = run
                elif base is not None and "error" not in run:
                    run["against_world_size_1"] = compare(base, run, dtype)
            except Exception as e:  # recorded; the next run still goes
                run = {"error": error_text(e)}
            run["cell"] = name
            result["cells"].append(run)
            write_json(args.out, result)
            _print_run(run)
    return result


def _print_run(run: dict[str, Any]) -> None:
    if "error" in run:
        print(f"data parallel {run['cell']}: {run['error']}", flush=True)
        return
    rate = run["train_tokens_per_s"] or 0
    line = (f"data parallel {run['cell']}: {run['train_tokens']} training tokens in "
            f"{run['train_s']:.2f}s train phase ({rate:.0f} tok/s)")  # fmt: skip
    vs = run.get("against_world_size_1")
    if vs:
        line += (f"; vs world size 1: x{vs['train_speedup_over_world_size_1'] or 0:.2f}, "
                 f"same rewards {vs['same_rewards']}, lora_B differs by "
                 f"{vs['adapter_lora_b_relative_diff'] or 0:.1e} of its norm "
                 f"(tolerance {vs['tolerance']:.0e}), max |diff| "
                 f"{vs['adapter_max_abs_diff']:.1e}")  # fmt: skip
    print(line, flush=True)


if __name__ == "__main__":
    main()
