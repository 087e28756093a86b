"""The GPU check: every arm, one after another, within one time budget, into one JSON.

    python bench/gpu_check.py --out OUT.json [--budget-s 570] [--arms scale,vllm,dp]
    python bench/gpu_check.py --dry-run --out OUT.json      (the same code, CPU, tiny)

bench/gpu.sh wraps this. Arms, each its own process (so one that crashes, hangs or holds
GPU memory cannot take the others with it), in this order:

- ``scale`` (bench/gpu_scale.py, issue 12): Qwen3-4B's shapes, N = 1/8/32 adapters,
  fused vs time-sliced, peak memory against the planner, tokens/s against the FLOP floor;
- ``vllm`` (bench/gpu_vllm.py, issue 13): the engine with the vLLM rollout backend,
  co-located with sleep mode, and on a second GPU where there is one;
- ``dp`` (bench/gpu_dp.py, issue 17): ``loraplex-engine run --world-size 1`` vs ``2``
  (and ``--shard-base`` where the engine has it) on two GPUs.

An arm that cannot run here (no vLLM, one GPU, a flag the engine lacks) is skipped with
its reason, before any time is spent on it. The budget left is shared among the arms
still to run by ``WEIGHTS``, so time an arm does not use goes to the next; each arm gets
a softer budget of its own (it skips cells past it) and is killed at its hard share, its
JSON so far kept. The merged JSON (``arms.<name>``: that arm's own JSON, plus how it
ended) is rewritten every few seconds while an arm runs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import REPO, Budget, error_text, gpu_count, run_in_group, write_json

DEFAULT_BUDGET_S = 570.0  # 9.5 minutes: a 10-minute device slot, less the start-up
RESERVE_S = 10.0  # kept back for the last write and the processes' exit


@dataclass(frozen=True)
class Arm:
    name: str
    script: str  # bench/<script>, run as its own process
    weight: float  # share of the budget left, against the arms still to run
    min_s: float  # below this it would measure nothing: skipped
    dry_run_min_s: float


ARMS = (
    Arm("scale", "gpu_scale.py", 0.35, 90.0, 20.0),
    Arm("vllm", "gpu_vllm.py", 0.45, 120.0, 30.0),
    Arm("dp", "gpu_dp.py", 0.20, 60.0, 15.0),
)


def why_skip(arm: Arm, dry_run: bool) -> str | None:
    """The arm module's own reason it cannot run here (scale: none; it needs only CUDA,
    which bench/gpu.sh checked)."""
    if arm.name == "scale":
        return None
    module = importlib.import_module(arm.script.removesuffix(".py"))
    return module.why_skip(dry_run)


def shares(budget_left: float, arms: list[Arm]) -> float:
    """The first arm's hard share of what is left, by weight among ``arms``."""
    total = sum(a.weight for a in arms)
    return max(0.0, budget_left - RESERVE_S) * arms[0].weight / total


def soft_budget(share: float) -> float:
    """What the arm itself is told: it stops starting cells past this, so that a cell
    begun just before it can still end within its hard share."""
    return share - min(max(15.0, 0.2 * share), 0.5 * share)


def device_name(dry_run: bool) -> str:
    if dry_run:
        return "cpu (dry run)"
    name = ""
    query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    if shutil.which(query[0]):  # not torch: this process holds no CUDA context
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            proc = subprocess.run(query, capture_output=True, text=True, timeout=30)
            name = (proc.stdout.strip().splitlines() or [""])[0].strip()
    return name or "cuda"


def run_arm(arm: Arm, share: float, args: argparse.Namespace, extra: list[str],
            tmp: Path, on_progress: Any) -> dict[str, Any]:  # fmt: skip
    """Run one arm's process; its JSON plus how it ended."""
    arm_out = tmp / f"{arm.name}.json"
    cmd = [sys.executable, str(REPO / "bench" / arm.script), "--out", str(arm_out),
           "--budget-s", f"{soft_budget(share):.0f}", *(["--dry-run"] if args.dry_run else []),
           *(extra if arm.name == "scale" else [])]  # fmt: skip

    def section() -> dict[str, Any]:
        try:
            return json.loads(arm_out.read_text()) if arm_out.exists() else {}
        except ValueError:  # mid-replace: the next poll reads it
            return {}

    started = time.monotonic()
    code = run_in_group(cmd, share, on_wait=lambda: on_progress(section() | {"running": True}))
    ended = {"exit_code": code, "budget_s": share, "wall_s": time.monotonic() - started}
    if code is None:
        ended["ended"] = f"killed at its {share:.0f}s share of the budget (results so far kept)"
    elif code != 0:
        ended["ended"] = f"exited with code {code} (its error is in the log above)"
    return section() | ended


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="bench/gpu.sh: gpu-<device>-<date>")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S)
    p.add_argument("--arms", default=",".join(a.name for a in ARMS))
    p.add_argument("--dry-run", action="store_true", help="every arm on the CPU, tiny")
    args, extra = p.parse_known_args(argv)  # the rest goes to the scale arm
    known = {a.name for a in ARMS}
    wanted = [a for a in args.arms.split(",") if a]
    if unknown := sorted(set(wanted) - known):
        p.error(f"--arms: unknown {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    args.arms = [a for a in ARMS if a.name in wanted]
    return args, extra


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args, extra = parse_args(argv)
    budget = Budget.of(args.budget_s)
    out = args.out
    result: dict[str, Any] = {
        "device": device_name(args.dry_run),
        "gpus": gpu_count(),
        "dry_run": args.dry_run,
        "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "budget_s": args.budget_s,
        "arms": {},
        "skipped": [],
    }
    to_run = []
    for arm in args.arms:
        try:
            why = why_skip(arm, args.dry_run)
        except Exception as e:  # a broken check skips its arm, not the run
            why = f"its check failed: {error_text(e)}"
        if why:
            result["skipped"].append({"arm": arm.name, "why": why})
            result["arms"][arm.name] = {"skipped_arm": why}
            print(f"arm {arm.name}: skipped ({why})", flush=True)
        else:
            to_run.append(arm)
    write_json(out, result)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for i, arm in enumerate(to_run):
            share = shares(budget.left(), to_run[i:])
            floor = arm.dry_run_min_s if args.dry_run else arm.min_s
            if share < floor:
                why = f"time budget: a {share:.0f}s share, under the {floor:.0f}s it needs"
                result["skipped"].append({"arm": arm.name, "why": why})
                result["arms"][arm.name] = {"skipped_arm": why}
                print(f"arm {arm.name}: skipped ({why})", flush=True)
                continue
            print(f"arm {arm.name}: {share:.0f}s of {budget.left():.0f}s left", flush=True)

            def progress(section: dict[str, Any], arm: Arm = arm) -> None:
                result["arms"][arm.name] = section
                write_json(out, result)

            try:
                progress(run_arm(arm, share, args, extra, Path(tmp), progress))
            except Exception as e:  # e.g. its process could not start: the next arm runs
                progress({"error": error_text(e)})
                print(f"arm {arm.name}: failed: {error_text(e)}", flush=True)
    result["elapsed_s"] = args.budget_s - budget.left()
    write_json(out, result)
    print(f"wrote {out} in {result['elapsed_s']:.0f}s", flush=True)
    return result


if __name__ == "__main__":
    main()
