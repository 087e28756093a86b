"""The torch rollout beside training on one GPU (issue 32): the pipelined schedule against
the sync one with ``--rollout-backend torch``, timed, with reward parity.

    python bench/gpu_pipelined.py --device cuda --out OUT/e2e.json --into torch_pipelined
    python bench/gpu_pipelined.py --device cpu --preset tiny --n 2 --steps 3 ...  (dry run)

Fresh engines in one process, sync then pipelined (``--rounds`` times while the budget
allows), each running throughput.py's N experiments (seeds, targets, lr spread) on-policy
(``maxStaleness`` 0) to their last step. Per run: wall seconds of its ticks, the ticks,
and for the pipelined one how many ticks ran the rollout on the side stream and, if not
every one, why the last did not (rollout/torch/streams.py). Parity, first round: each
experiment's rewards step by step equal between the schedules, and its adapter's weights
apart by at most a float reassociation (tests/engine/tick/test_pipelined.py's bound, relative
to how far the updates moved them). On the CPU (the dry run) the side stream is never
taken: the run checks the stage's plumbing and that parity.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput

# tests/engine/tick/test_pipelined.py's bound: fp32 sums in another order, amplified by Adam.
WEIGHT_TOLERANCE = 1e-3


def slot_weights(eng: Any, exp_id: str) -> torch.Tensor:
    slot = eng.model.slot_of(exp_id)
    parts = [p[slot].detach().float().flatten().cpu() for layer in eng.model.lora_layers.values()
             for p in (layer.lora_A, layer.lora_B)]  # fmt: skip
    return torch.cat(parts)


def run_once(args: argparse.Namespace, targs: Any, schedule: str) -> dict[str, Any]:
    """One engine, one schedule, every experiment to its last step."""
    from loraplex_engine.engine import Engine
    from loraplex_engine.settings.engine import EngineSettings
    from loraplex_engine.spec.experiment import parse_spec

    settings = EngineSettings(
        max_adapters=args.n,
        max_rank=targs.rank,
        checkpoint_root=tempfile.mkdtemp(prefix=f"gpu-pipelined-{schedule}-"),
        rollout_backend="torch",
        schedule=schedule,
        dtype=args.dtype,
    )
    eng = Engine(targs.model_dir, settings, device=args.device, ignore_eos=True)
    specs = throughput.experiment_specs(args.n, args.steps, targs)
    for e in specs:
        eng.put_experiment(e["id"], parse_spec(e["spec"]), "bench", e["id"][6:])
    start = {e["id"]: slot_weights(eng, e["id"]) for e in specs}
    rewards: dict[str, list[float]] = {e["id"]: [] for e in specs}
    ticks = 0
    sync_device(args.device)
    wall0 = time.perf_counter()
    while (report := eng.tick()) is not None:
        ticks += 1
        for t in report.experiments:
            if t.failed_reason is None and t.id in rewards and t.eval is None:
                rewards[t.id].append(t.reward)
    sync_device(args.device)
    wall = time.perf_counter() - wall0
    tick = eng._tick
    row: dict[str, Any] = {
        "schedule": schedule,
        "wall_s": wall,
        "ticks": ticks,
        "rewards": rewards,
        "phases": [e.phase for e in (eng.get_experiment(s["id"]) for s in specs)],
        "weights": {i: (start[i], slot_weights(eng, i)) for i in rewards},
    }
    if schedule == "pipelined":
        row["side_stream_ticks"] = tick.side_stream_ticks
        row["stream_blocker"] = tick.stream_blocker
    eng.close()
    return row


def sync_device(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def parity(sync: dict[str, Any], piped: dict[str, Any]) -> dict[str, Any]:
    """Rewards step by step and weights (relative to how far the updates moved them)."""
    out: dict[str, Any] = {"experiments": {}}
    for exp_id, theirs in sync["rewards"].items():
        mine = piped["rewards"][exp_id]
        start, b = sync["weights"][exp_id]
        _, a = piped["weights"][exp_id]
        moved = float((b - start).norm())
        rel = float((a - b).norm()) / moved if moved else float("inf")
        out["experiments"][exp_id] = {"rewards_equal": mine == theirs, "steps": len(mine),
                                      "weights_rel_diff": rel}  # fmt: skip
    rows = out["experiments"].values()
    out["rewards_equal"] = all(r["rewards_equal"] for r in rows)
    out["weights_rel_diff_max"] = max(r["weights_rel_diff"] for r in rows)
    out["ok"] = out["rewards_equal"] and out["weights_rel_diff_max"] <= WEIGHT_TOLERANCE
    return out


def write(args: argparse.Namespace, result: dict[str, Any]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.into:
        whole = json.loads(args.out.read_text()) if args.out.exists() else {}
        result = {**whole, args.into: result}
    args.out.write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="bench", choices=["tiny", "bench"])
    p.add_argument("--n", type=int, default=8, help="experiments")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32", help="float32: parity is not bf16 noise")
    p.add_argument("--budget-s", type=float, default=55.0)
    p.add_argument("--into", default=None, metavar="KEY",
                   help="write under KEY of the JSON object already at --out")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("out/bench/gpu-pipelined.json"))
    args = p.parse_args(argv)
    started = time.monotonic()
    targs = throughput.parse_args([f"--preset={args.preset}"])
    if not (targs.model_dir / "config.json").exists():
        from loraplex_engine.dev.tiny_model import build_model

        build_model(targs.model_dir, preset=args.preset)
    result: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "model": throughput.model_info(targs.model_dir),
        "n": args.n, "steps": args.steps, "dtype": args.dtype,
        "ran_on_gpu": args.device.startswith("cuda"), "runs": [],
    }  # fmt: skip
    write(args, result)
    first: dict[str, dict[str, Any]] = {}
    for round_no in range(args.rounds):
        for schedule in ("sync", "pipelined"):
            spent = time.monotonic() - started
            last = max((r["wall_s"] for r in result["runs"]), default=0.0)
            if round_no and spent + 2.5 * last > args.budget_s:  # no time for one more pair
                break
            row = run_once(args, targs, schedule)
            first.setdefault(schedule, row)
            result["runs"].append({k: v for k, v in row.items() if k != "weights"})
            print(f"{schedule}: {row['wall_s']:.2f}s, {row['ticks']} ticks"
                  f"{_side(row)}", flush=True)  # fmt: skip
            write(args, result)
    summarize(result, first)
    write(args, result)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1), flush=True)
    return 0


def _side(row: dict[str, Any]) -> str:
    if row["schedule"] != "pipelined":
        return ""
    return f", side stream in {row['side_stream_ticks']} (last blocker: {row['stream_blocker']})"


def summarize(result: dict[str, Any], first: dict[str, dict[str, Any]]) -> None:
    def median(schedule: str) -> float:
        return statistics.median(r["wall_s"] for r in result["runs"] if r["schedule"] == schedule)

    if "sync" in first and "pipelined" in first:
        result["parity"] = parity(first["sync"], first["pipelined"])
        result["wall_s_median"] = {s: median(s) for s in ("sync", "pipelined")}
        result["speedup"] = result["wall_s_median"]["sync"] / result["wall_s_median"]["pipelined"]


if __name__ == "__main__":
    sys.exit(main())
