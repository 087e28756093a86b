"""The GPU check at real scale: Qwen3-4B's shapes, 1/8/32 adapters, bf16, checkpointing.

    python bench/gpu_scale.py                 (bench/gpu.sh wraps this; CUDA, < 10 min)
    python bench/gpu_scale.py --dry-run --out OUT.json   (the same code, CPU, tiny)

1. Builds a random-weight model from ``--config`` (default bench/configs/qwen3-4b.json;
   ``--layers`` keeps fewer decoder layers if the time is short) straight on the device,
   base in bf16; no downloads, no tokenizer (token ids are synthetic).
2. Measures the device's bf16 matmul rate (bench/gpu_bench.py's GEMM loop).
3. Starts the memory planner (planner.plan, fake tensors on the host's CPUs) for the
   same workload at every N, in parallel processes, while the device works.
4. For N = 1, 8, 32 adapters at rank 32 on every linear (LoRA weights and Adam moments
   fp32): one GRPO training step of every tenant's rows through the engine's own
   strategies (training_strategy.FusedTraining, timesliced.TimeSlicedTraining), whose
   backward computes log-probs chunk by chunk and, here, checkpoints every layer.
   Reports the step's seconds (median of ``--repeats`` after a warm-up), training
   tokens/s, the FLOP floor ``(4P + 6P_L)·T + 3F_a·T`` (planner.floor_flops) as a share
   of the measured bf16 rate, and the peak ``torch.cuda.max_memory_allocated`` of the
   fused step against the planner's predicted training peak. ``one_at_a_time`` is
   N × the N=1 fused step: what a system that holds one adapter per device spends per
   round, without any swap (time-sliced is the resident-slots baseline, with its real
   host copies).
5. Before the cells, one q_proj-shaped layer's LoRA delta on the bmm path vs the grouped
   path (``torch._grouped_mm`` on sm90/sm100; bench/grouped_lora.py's three workloads):
   the FLOPs each needs and each one's forward+backward time (``grouped_lora``).

Writes one JSON (``--out``, default bench/results/gpu-<device>-<date>.json) after every
arm of every cell, so a run cut short by its time slot still leaves what it measured. An
arm or a cell that raises (out of memory, a kernel error) is recorded as its ``error``
and the next one runs. ``--lora-kernel bmm`` keeps the cells off the grouped kernel
(bench/gpu_device.sh passes it when its kernel check failed).
``--dry-run`` shrinks the model (2 layers, hidden 64), N to 1 and 2, and the rows, and runs
on the CPU: the plumbing (strategies, checkpointing, planner, floor arithmetic, output)
is what it checks; the CPU has no allocator peak, so ``measured_peak_bytes`` is null.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grouped_lora as grouped_bench
from gpu_bench import bf16_matmul_flops
from gpu_common import error_text, write_json
from loraplex_engine.dev.timesliced import TimeSlicedTraining
from loraplex_engine.lora.grouped import KERNEL_MODES
from loraplex_engine.lora.layers import LoRAConfig
from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.memory.planner import Workload, floor_flops, linear_weights, plan, tenant_rows
from loraplex_engine.train.algorithms import ClippedRatioLoss
from loraplex_engine.train.optim import AdamWSettings, PerAdapterAdamW
from loraplex_engine.train.rows import TrainRow
from loraplex_engine.train.strategy import FusedTraining
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

REPO = Path(__file__).resolve().parents[1]
QWEN3_4B = REPO / "bench/configs/qwen3-4b.json"
# Qwen3's layout (GQA 2:1, head_dim set, tied head), small enough for a CPU in seconds.
DRY_RUN_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "num_hidden_layers": 2,
    "max_window_layers": 2,
}
ARMS = ("fused", "timesliced")
PLAN_WAIT_S = 10.0  # per cell, for its planner row, before the next cell starts


def model_config(path: Path, layers: int | None, dry_run: bool) -> PretrainedConfig:
    values = json.loads(path.read_text())
    if dry_run:
        values |= DRY_RUN_SHAPE
    if layers:
        values["num_hidden_layers"] = values["max_window_layers"] = layers
    return AutoConfig.for_model(**values)


def build(
    config: PretrainedConfig, w: Workload, device: torch.device
) -> tuple[MultiLoRAModel, PerAdapterAdamW]:
    """Random base in ``w.dtype`` on the device, ``w.adapters`` slots at ``w.rank``."""
    torch.manual_seed(0)
    with device:
        base = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, w.dtype)).eval()
        model = MultiLoRAModel(base, w.adapters, w.rank, w.targets, dtype=torch.float32)
    optimizer = PerAdapterAdamW(model)
    lora = LoRAConfig(rank=w.rank, alpha=2.0 * w.rank, target_modules=tuple(model.target_modules))
    for i in range(w.adapters):
        model.add_adapter(f"tenant-{i}", lora, seed=i)
        optimizer.add_adapter(f"tenant-{i}", AdamWSettings(lr=1e-5, weight_decay=0.0))
    for layer in model.lora_layers.values():  # nonzero B, as after some training
        torch.nn.init.normal_(layer.lora_B, std=1e-3)
    return model.train(), optimizer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_arm(trainer: Any, rows: list[TrainRow], updates: dict, repeats: int) -> dict[str, Any]:
    """Seconds of one training step (every tenant), median of ``repeats`` after a warm-up."""
    times, failures = [], []
    for i in range(1 + repeats):
        trainer.computed_tokens = 0
        _sync(trainer.device)
        started = time.perf_counter()
        outcomes = trainer.train(rows, updates)
        _sync(trainer.device)
        if i:
            times.append(time.perf_counter() - started)
        failures += [o.failure for o in outcomes.values() if o.failure]
    return {"step_s": statistics.median(times), "steps_s": times,
            "tokens": trainer.computed_tokens, "failures": failures}  # fmt: skip


def run_cell(
    config: PretrainedConfig, w: Workload, device: torch.device, repeats: int, rate: float,
    cell: dict[str, Any], opts: CellOptions,
) -> None:  # fmt: skip
    """Both arms for one N on one model into ``cell``: seconds, tokens/s, floor share, peak
    memory. An arm that raises (an out-of-memory, a kernel error) is recorded under its
    name and the other arm still runs; ``opts.save`` runs after each arm, so a run killed
    in the time-sliced arm keeps the fused numbers."""
    model, optimizer = build(config, w, device)
    model.set_grouped_mm(KERNEL_MODES[opts.lora_kernel])
    rows = tenant_rows(model, w, w.adapters)
    updates = {r.experiment: ClippedRatioLoss() for r in rows}
    p_base, p_lora = linear_weights(model, w.rank)
    cell |= {"frozen_linear_params": p_base, "lora_params_per_adapter": p_lora,
             "lora_kernel": opts.lora_kernel}  # fmt: skip
    common = {"model": model, "optimizer": optimizer, "device": device, "pad_id": 0,
              "micro_batch_tokens": w.micro_batch_tokens, "shared_forward": None,
              "gradient_checkpointing": w.checkpointing}  # fmt: skip
    try:
        for arm, strategy in zip(ARMS, (FusedTraining, TimeSlicedTraining), strict=True):
            if opts.past_budget():
                cell["arms"][arm] = {"skipped": "time budget"}
                continue
            try:
                if (w.adapters, arm) == opts.fail_at:
                    raise RuntimeError(f"injected failure (--fail-cell {w.adapters})")
                got = run_arm(strategy(**common), rows, updates, repeats)
                got |= arm_rates(config, got, (p_base, p_lora), w.row_tokens, rate, device)
            except Exception as e:  # recorded; the next arm and the next cell still run
                got = {"error": error_text(e)}
                print(f"N={w.adapters} {arm}: failed: {got['error']}", flush=True)
            cell["arms"][arm] = got
            free(device)
            opts.save()
    finally:
        del model, optimizer, common
        free(device)


def run_arm(trainer: Any, rows: list[TrainRow], updates: dict, repeats: int) -> dict[str, Any]:
    """One strategy's timed steps, reset peak first (the arm's own peak is recorded)."""
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    got = time_arm(trainer, rows, updates, repeats)
    got["checkpointing"] = trainer.gradient_checkpointing  # as the strategy ran it
    return got


def arm_rates(
    config: PretrainedConfig, got: dict[str, Any], params: tuple[int, int], row_tokens: int,
    rate: float, device: torch.device,
) -> dict[str, Any]:  # fmt: skip
    """Tokens/s, the FLOP floor and its share of the bf16 rate, the allocator's peak."""
    floor = floor_flops(config, *params, got["tokens"], row_tokens)
    return {
        "tokens_per_s": got["tokens"] / got["step_s"],
        "floor_flops": floor,
        "floor_fraction_of_bf16_peak": floor / got["step_s"] / rate,
        "measured_peak_bytes": (
            torch.cuda.max_memory_allocated() if device.type == "cuda" else None
        ),
    }


def free(device: torch.device) -> None:
    """Give back what a finished (or failed) arm held, so the next starts clean."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class CellOptions:
    lora_kernel: str  # the engine's --lora-kernel name: auto, bmm or grouped
    save: Callable[[], None]  # writes the result so far
    past_budget: Callable[[], bool]  # no new arm starts once this is true
    fail_at: tuple[int, str] | None = None  # rehearsal only: (N, arm) raises


def grouped_lora_arm(
    config: PretrainedConfig, device: torch.device, dry_run: bool
) -> dict[str, Any]:
    """One q_proj-shaped layer's LoRA delta, bmm vs grouped (bench/grouped_lora.py's
    workloads: mixed ranks, uneven groups, uniform), bf16, forward + backward.

    On CUDA ``auto`` takes the fused ``torch._grouped_mm`` where the device qualifies
    (``paths`` says what ran); the dry run forces the grouped algorithm's reference loop.
    """
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shapes = (config.hidden_size, config.num_attention_heads * head_dim, 64)
    tokens = 16 if dry_run else 512
    modes = {"bmm": "never", "grouped": "always" if dry_run else "auto"}
    return {
        name: grouped_bench.measure(ranks, rows, tokens, shapes, device, 5, modes, dry_run)
        for name, (ranks, rows) in grouped_bench.WORKLOADS.items()
    }


def _plan_row(config: dict[str, Any], workload: dict[str, Any], device_bytes: int) -> dict:
    """One planner row in a worker process (fake tensors: host CPU only)."""
    torch.set_num_threads(1)
    cfg = AutoConfig.for_model(**config)
    # Cut to 3 and 4 layers and extended to the full depth: the same bytes as every layer
    # (bench/results/memory-plan-full-depth.json), seconds instead of minutes.
    cut = (3, 4) if cfg.num_hidden_layers > 4 else None
    return plan(cfg, Workload(**workload), device_bytes, cut_layers=cut)


def start_plans(
    config: PretrainedConfig, workloads: list[Workload], device_bytes: int
) -> tuple[Any, dict[int, Any]]:
    # Half the host's cores at most: the device's own process needs CPU to launch kernels
    # (on a 2-core CI box the plans run one after another, behind the dry run's cells).
    workers = max(1, min(len(workloads), (os.cpu_count() or 2) // 2))
    pool = multiprocessing.get_context("spawn").Pool(workers)
    pending = {
        w.adapters: pool.apply_async(_plan_row, (config.to_dict(), asdict(w), device_bytes))
        for w in workloads
    }
    return pool, pending


def plan_comparison(pending: Any, cell: dict[str, Any], wait_s: float) -> dict[str, Any]:
    """The planner's training peak for this N beside the measured one (None if the plan
    did not finish within ``wait_s``)."""
    try:
        row = pending.get(timeout=max(wait_s, 0.1))
    except multiprocessing.TimeoutError:
        return {"plan": None, "plan_error": f"planner not done within {wait_s:.0f}s"}
    except Exception as e:  # a failed plan is a result to record, not a reason to stop
        return {"plan": None, "plan_error": f"{type(e).__name__}: {e}"}
    predicted = row["detail"]["train_total"]
    measured = (_measured(cell, "fused") or {}).get("measured_peak_bytes")
    return {
        "plan": row,
        "predicted_train_peak_bytes": predicted,
        "measured_over_predicted": measured / predicted if measured else None,
        "planner_floor_flops": row["floor_flops"],
        "planner_train_flops": row["train_flops"],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="result JSON (default bench/results/gpu-*.json)")
    p.add_argument("--config", type=Path, default=QWEN3_4B)
    p.add_argument("--layers", type=int, help="decoder layers to keep (default: all)")
    p.add_argument("--ns", help="adapter counts (default 1,8,32; dry run 1,2)")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--prompts-per-tenant", type=int, default=1)
    p.add_argument("--completions-per-prompt", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--completion-tokens", type=int, default=384)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--no-checkpointing", action="store_true")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=540, help="skip cells past this")
    p.add_argument("--dry-run", action="store_true", help="tiny model on the CPU")
    p.add_argument("--lora-kernel", choices=sorted(KERNEL_MODES), default="auto",
                   help="the LoRA delta's path, as the engine's --lora-kernel (bench/"
                   "gpu_device.sh: bmm when its grouped-kernel check failed)")  # fmt: skip
    p.add_argument(
        "--no-grouped-arm",
        dest="grouped_arm",
        action="store_false",
        help="skip the bmm-vs-grouped layer timing (gpu_device.sh checks it apart)",
    )
    p.add_argument(
        "--fail-cell",
        type=int,
        metavar="N",
        help="rehearsal: N's fused arm raises, to show the run goes on",
    )
    args = p.parse_args(argv)
    if args.dry_run:
        args.ns, args.rank, args.repeats = args.ns or "1,2", 4, 1
        args.prompts_per_tenant, args.completions_per_prompt = 1, 2
        args.prompt_tokens, args.completion_tokens, args.micro_batch_tokens = 8, 8, 32
    return args


def workload(args: argparse.Namespace, n: int) -> Workload:
    return Workload(
        adapters=n, rank=args.rank, prompts_per_tenant=args.prompts_per_tenant,
        completions_per_prompt=args.completions_per_prompt, prompt_tokens=args.prompt_tokens,
        completion_tokens=args.completion_tokens, dtype="bfloat16",
        checkpointing=not args.no_checkpointing, micro_batch_tokens=args.micro_batch_tokens,
    )  # fmt: skip


def device_info(device: torch.device) -> tuple[str, int]:
    if device.type != "cuda":
        return "cpu (dry run)", 16 << 30
    return torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.monotonic()
    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.dry_run:
        torch.set_num_threads(1)  # the planner's processes share the CPU
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_scale: torch sees no CUDA device (--dry-run rehearses on the CPU)")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    name, device_bytes = device_info(device)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M")
    slug = name.split()[-1].lower() if device.type == "cuda" else "dry-run"
    out = args.out or REPO / f"bench/results/gpu-{slug}-{stamp}.json"
    config = model_config(args.config, args.layers, args.dry_run)
    ns = [int(n) for n in (args.ns or "1,8,32").split(",")]
    workloads = [workload(args, n) for n in ns]
    pool, pending = start_plans(config, workloads, device_bytes)
    rate = bf16_matmul_flops(str(device), 256 if args.dry_run else 8192)
    result: dict[str, Any] = {
        "device": name, "dry_run": args.dry_run, "device_bytes": device_bytes,
        "torch": torch.__version__, "config": str(args.config),
        "layers": config.num_hidden_layers, "bf16_matmul_flops_per_s": rate,
        "workload": asdict(workloads[0]) | {"adapters": ns}, "lora_kernel": args.lora_kernel,
        "cells": [], "skipped": [],
    }  # fmt: skip
    print(f"{name}: bf16 matmul {rate / 1e12:.2f} TFLOP/s; {config.num_hidden_layers} layers")
    if args.grouped_arm:  # seconds; a failure here is recorded, the scale cells still run
        try:
            result["grouped_lora"] = grouped_lora_arm(config, device, args.dry_run)
            _print_grouped(result["grouped_lora"])
        except Exception as e:
            result["grouped_lora"] = {"error": error_text(e)}
            print(f"grouped LoRA arm failed: {result['grouped_lora']['error']}", flush=True)
    write_json(out, result)
    past_budget = lambda: time.monotonic() - started > args.budget_s  # noqa: E731
    fail_at = (args.fail_cell, "fused") if args.fail_cell else None
    try:
        for w in workloads:
            if past_budget():
                result["skipped"].append({"n": w.adapters, "why": "time budget"})
                continue
            cell: dict[str, Any] = {"n": w.adapters, "arms": {}}
            result["cells"].append(cell)  # in the file from its first arm on
            opts = CellOptions(args.lora_kernel, lambda: write_json(out, result), past_budget,
                               fail_at)  # fmt: skip
            run_one(config, w, device, (args.repeats, rate), cell, opts)
            # A short wait: the next cells' plans run meanwhile, and a slow one must not
            # hold up the cells; those still running are waited for after the last.
            cell |= plan_comparison(pending[w.adapters], cell, PLAN_WAIT_S)
            _add_one_at_a_time(result["cells"], cell)
            write_json(out, result)
            _print_cell(cell)
        for cell in result["cells"]:
            if cell["plan"] is None and "not done" in cell["plan_error"]:
                left = args.budget_s - (time.monotonic() - started)
                cell |= plan_comparison(pending[cell["n"]], cell, left)
                write_json(out, result)
    finally:
        pool.terminate()
    result["elapsed_s"] = time.monotonic() - started
    write_json(out, result)
    print(f"wrote {out} in {result['elapsed_s']:.0f}s")
    return result


def run_one(
    config: PretrainedConfig, w: Workload, device: torch.device, timing: tuple[int, float],
    cell: dict[str, Any], opts: CellOptions,
) -> None:  # fmt: skip
    """One cell; a failure outside the arms (building the model: out of memory at N=32)
    is the cell's ``error``, and the next cell still runs."""
    try:
        run_cell(config, w, device, *timing, cell, opts)
    except Exception as e:
        cell["error"] = error_text(e)
        print(f"N={w.adapters}: cell failed: {cell['error']}", flush=True)
        free(device)
    opts.save()


def _add_one_at_a_time(done: list[dict[str, Any]], cell: dict[str, Any]) -> None:
    """N × the N=1 fused step, once N=1's fused arm has run (see the module doc)."""
    single = next((c for c in done if c["n"] == 1), cell if cell["n"] == 1 else None)
    one = _measured(single, "fused") if single else None
    fused = _measured(cell, "fused")
    if one is None or fused is None:
        return
    step_s = cell["n"] * one["step_s"]
    tokens = fused["tokens"]
    cell["arms"]["one_at_a_time"] = {"step_s": step_s, "tokens": tokens,
                                     "tokens_per_s": tokens / step_s, "derived": True}  # fmt: skip
    cell["ratios"] = {f"{arm}_over_fused": cell["arms"][arm]["step_s"] / fused["step_s"]
                      for arm in ("timesliced", "one_at_a_time")
                      if _measured(cell, arm)}  # fmt: skip


def _measured(cell: dict[str, Any], arm: str) -> dict[str, Any] | None:
    """The arm's numbers, or None where it failed or was skipped."""
    got = cell["arms"].get(arm)
    return got if got and "step_s" in got else None


def _print_grouped(workloads: dict[str, Any]) -> None:
    for name, got in workloads.items():
        wall = got["wall_s"]
        print(f"LoRA delta {name:>13}: FLOPs bmm/grouped {got['bmm_over_grouped_flops']:.2f}x,"
              f" fwd+bwd bmm {wall['bmm'] * 1e3:.2f} ms, {got['paths']['grouped']}"
              f" {wall['grouped'] * 1e3:.2f} ms", flush=True)  # fmt: skip


def _print_cell(cell: dict[str, Any]) -> None:
    mib = 1 << 20
    for arm, got in cell["arms"].items():
        if "step_s" not in got:
            print(f"N={cell['n']:>3} {arm:<14} {got.get('error') or got.get('skipped')}")
            continue
        peak = got.get("measured_peak_bytes")
        share = got.get("floor_fraction_of_bf16_peak")
        print(f"N={cell['n']:>3} {arm:<14} {got['step_s']:8.3f}s {got['tokens_per_s']:10.0f} tok/s"
              + (f" floor/peak {share:.3f}" if share is not None else "")
              + (f" peak {peak / mib:.0f} MiB" if peak else ""), flush=True)  # fmt: skip
    predicted = cell.get("predicted_train_peak_bytes")
    planned = f"{predicted / mib:.1f} MiB" if predicted else cell.get("plan_error", "?")
    print(f"N={cell['n']:>3} planner train peak {planned}")


if __name__ == "__main__":
    main()
