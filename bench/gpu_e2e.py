"""The engine end to end on a GPU: `loraplex-engine run --device cuda` of the demo.

    python bench/gpu_e2e.py --out OUT/e2e.json --device cuda --budget-s 115
    python bench/gpu_e2e.py --out e2e.json --device cpu --manifest SHORT.yaml   (rehearsal)

bench/gpu_device.sh's last stage, the only whole-engine run on the lent machine (the
vLLM and world-size arms cannot run there). Builds the tiny model (`tiny-model`), then
runs the manifest (default samples/local/demo.yaml: four experiments, 30 steps) with
``--train-mode fused``, then, if the budget still holds a run as long again, with
``--train-mode timesliced``; each run is a `python -m loraplex_engine.cli run` of its
own (the console script is not installed on the device). Per run: how it ended, each
experiment's phase, steps and reward curve, the engine's phase seconds. Reward parity:
per experiment, the last-k mean reward of the two runs within 2 SE (bench/throughput.py's
test, here over one trajectory each). The JSON is rewritten after every step.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import REPO, Budget, error_text, write_json
from throughput import _mean_se, last_k

MODES = ("fused", "timesliced")
RESERVE_S = 5.0  # kept for the last write
MIN_RUN_S = 20.0  # less than this left: a run would only be killed


def engine(*args: str) -> list[str]:
    return [sys.executable, "-m", "loraplex_engine.cli", *args]


def timed(cmd: list[str], timeout_s: float) -> dict[str, Any]:
    """Run ``cmd`` (its output goes to ours, the log); how it ended and its seconds.
    Same process group as this one: a stage killed at its limit takes it along."""
    started = time.monotonic()
    try:
        code: int | None = subprocess.run(cmd, timeout=max(1.0, timeout_s)).returncode
    except subprocess.TimeoutExpired:
        code = None
    got: dict[str, Any] = {"exit_code": code, "wall_s": time.monotonic() - started}
    if code is None:
        got["error"] = f"killed at {timeout_s:.0f}s"
    return got


def read_summary(out_dir: Path) -> dict[str, Any]:
    """The run's summary.json, cut to what the check reports."""
    path = out_dir / "summary.json"
    if not path.exists():
        return {"summary": None}
    summary = json.loads(path.read_text())
    keep = ("name", "phase", "steps", "reward_first", "reward_last", "rewards", "error")
    return {
        "engine_wall_s": summary.get("wall_seconds"),
        "phase_s": summary.get("phase_seconds"),
        "experiments": [{k: e.get(k) for k in keep} for e in summary["experiments"]],
    }


def parity(fused: dict[str, Any], sliced: dict[str, Any]) -> list[dict[str, Any]]:
    """Per experiment: last-k mean reward, fused vs time-sliced, within 2 SE."""
    other = {e["name"]: e for e in sliced.get("experiments", [])}
    out = []
    for exp in fused.get("experiments", []):
        twin = other.get(exp["name"])
        if not twin or not exp["rewards"] or not twin["rewards"]:
            continue
        k = last_k(min(len(exp["rewards"]), len(twin["rewards"])))
        (mf, sef), (ms, ses) = _mean_se(exp["rewards"][-k:]), _mean_se(twin["rewards"][-k:])
        bound = 2 * math.sqrt(sef**2 + ses**2)
        out.append({"experiment": exp["name"], "k": k, "fused_last_k_mean": mf,
                    "timesliced_last_k_mean": ms,
                    "within_2se": abs(mf - ms) <= bound + 1e-9})  # fmt: skip
    return out


def run_mode(mode: str, model: Path, args: argparse.Namespace, budget: Budget) -> dict:
    out_dir = args.work / mode
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd = engine("run", str(args.manifest), "--model", str(model), "--out", str(out_dir),
                 "--device", args.device, "--train-mode", mode)  # fmt: skip
    print(f"e2e {mode}: {' '.join(cmd[1:])}", flush=True)
    got = {"command": cmd[1:]} | timed(cmd, budget.left() - RESERVE_S) | read_summary(out_dir)
    experiments = got.get("experiments") or []
    got["succeeded"] = got["exit_code"] == 0 and all(e["phase"] == "Succeeded" for e in experiments)
    return got


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    budget = Budget.of(args.budget_s)
    result: dict[str, Any] = {"device": args.device, "manifest": str(args.manifest),
                              "budget_s": args.budget_s, "runs": {}, "skipped": []}  # fmt: skip
    write_json(args.out, result)
    model = args.work / "tiny-llama"
    shutil.rmtree(model, ignore_errors=True)
    try:
        result["model"] = timed(engine("tiny-model", "--out", str(model)), min(90, budget.left()))
    except Exception as e:  # e.g. the interpreter could not start: recorded, not raised
        result["model"] = {"error": error_text(e)}
    write_json(args.out, result)
    if result["model"].get("exit_code") != 0:
        print(f"e2e: no model: {result['model']}", flush=True)
        return 1
    for mode in MODES:
        need = MIN_RUN_S
        if mode != MODES[0] and "wall_s" in result["runs"].get(MODES[0], {}):
            need = max(need, 1.2 * result["runs"][MODES[0]]["wall_s"])
        if not budget.allows(need + RESERVE_S):
            why = f"time budget: {budget.left():.0f}s left, a run needs ~{need:.0f}s"
            result["skipped"].append({"run": mode, "why": why})
            print(f"e2e {mode}: skipped ({why})", flush=True)
            continue
        result["runs"][mode] = run_mode(mode, model, args, budget)
        write_json(args.out, result)
    _finish(args, result)
    return 0 if result["runs"].get("fused", {}).get("succeeded") else 1


def _finish(args: argparse.Namespace, result: dict[str, Any]) -> None:
    runs = result["runs"]
    if all(runs.get(m, {}).get("succeeded") for m in MODES):
        result["reward_parity"] = parity(runs["fused"], runs["timesliced"])
    png = args.work / "fused" / "rewards.png"
    if args.png and png.exists():
        shutil.copyfile(png, args.png)
    write_json(args.out, result)
    for mode, got in runs.items():
        rewards = {e["name"]: e["reward_last"] for e in got.get("experiments") or []}
        print(f"e2e {mode}: exit {got['exit_code']} in {got['wall_s']:.1f}s, last rewards "
              f"{rewards}", flush=True)  # fmt: skip
    if "reward_parity" in result:
        ok = sum(p["within_2se"] for p in result["reward_parity"])
        print(f"e2e reward parity (fused vs time-sliced, last-k within 2 SE): "
              f"{ok}/{len(result['reward_parity'])}", flush=True)  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the result JSON")
    p.add_argument("--device", default="cuda", help="as `run --device` takes it")
    p.add_argument("--manifest", type=Path, default=REPO / "samples/local/demo.yaml")
    p.add_argument("--work", type=Path, default=Path("/tmp/gpu-device-e2e"),
                   help="model and run outputs (not $OUT: they are many files)")  # fmt: skip
    p.add_argument("--png", type=Path, help="copy the fused run's rewards.png here")
    p.add_argument("--budget-s", type=float, default=115.0)
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
