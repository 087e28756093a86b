"""Fused vs time-sliced training on SkyRL PR #1938's two workloads (issue 32 item 4).

    .venv/bin/python bench/fused_workloads.py [--n 8] [--seq 64] [--steps 11]
                                              [--out bench/results/fused-workloads.json]

- ``underfilled``: one sequence per adapter per step. Fused packs every adapter's row
  into one micro-batch (one base forward/backward for all); time-sliced runs one
  one-row forward/backward per adapter, plus the swap of its weights and moments.
- ``saturated``: each adapter's rows alone fill the micro-batch (``micro_batch_tokens``
  = rows x seq), so both arms run N full micro-batches; fused can gain only the per-step
  overheads (one optimiser call, no swaps), and must not lose.

Both arms are the engine's own strategies (``train_mode`` fused and timesliced:
train/strategy.py FusedTraining, dev/timesliced.py) on the same model, adapters and
rows (random tokens, advantages +-1), so this times the training step alone. Steps
alternate between the arms (A B B A ...) so load hits both alike; medians after one
untimed step each, of wall seconds and of the process's CPU seconds (one torch thread:
on a shared machine the CPU time is the work, the wall time adds the others' load).
Ratio = time-sliced median / fused median (> 1: fused is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput

ARMS = ("fused", "timesliced")


def workload_rows(name: str, n: int, seq: int, saturated_rows: int) -> int:
    """Rows per adapter per step."""
    return 1 if name == "underfilled" else saturated_rows


def make_engine(args: argparse.Namespace, mode: str, micro_batch_tokens: int) -> Any:
    from loraplex_engine.engine import Engine
    from loraplex_engine.settings.engine import EngineSettings
    from loraplex_engine.spec.experiment import parse_spec

    targs = throughput.parse_args([f"--preset={args.preset}"])
    settings = EngineSettings(
        max_adapters=args.n,
        max_rank=targs.rank,
        checkpoint_root=tempfile.mkdtemp(prefix="fused-workloads-"),
        train_mode=mode,
        micro_batch_tokens=micro_batch_tokens,
        gradient_checkpointing=False,
    )
    # No shared prompt prefix: each row is its own prompt here.
    eng = Engine(
        targs.model_dir, settings, device=args.device, ignore_eos=True, share_prompt_prefix=False
    )
    for e in throughput.experiment_specs(args.n, 1000, targs):
        eng.put_experiment(e["id"], parse_spec(e["spec"]), "bench", e["id"][6:])
    return eng


def make_rows(eng: Any, rows: int, seq: int, seed: int) -> tuple[list[Any], dict[str, Any]]:
    from loraplex_engine.train.experiment_rows import step_loss
    from loraplex_engine.train.rows import TrainRow

    gen = torch.Generator().manual_seed(seed)
    vocab = min(eng.model.base_model.config.vocab_size, 200)
    prompt = seq // 2
    out: list[TrainRow] = []
    losses = {}
    for exp in sorted(eng._experiments.values(), key=lambda e: e.id):
        mine = []
        for r in range(rows):
            ids = torch.randint(4, vocab, (seq,), generator=gen).tolist()
            mine.append(
                TrainRow(
                    exp.id,
                    eng.model.slot_of(exp.id),
                    ids[:prompt],
                    ids[prompt:],
                    [-3.0] * (seq - prompt),
                    1.0 if r % 2 == 0 else -1.0,
                    1.0,
                )
            )
        out += mine
        losses[exp.id] = step_loss(exp.algorithm, mine)
    return out, losses


def time_step(eng: Any, rows: list[Any], losses: dict[str, Any]) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds of one training step (one torch
    thread: the CPU time is the work done, whatever the machine's other load; on a GPU
    the wall time, synchronised, is the measure)."""
    eng.model.train()
    _sync(eng)
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        eng.strategy.train(rows, losses)
        _sync(eng)
    finally:
        eng.model.eval()
    return time.perf_counter() - t0, time.process_time() - c0


def _sync(eng: Any) -> None:
    if eng.device.type == "cuda":
        torch.cuda.synchronize(eng.device)


def run_workload(args: argparse.Namespace, name: str) -> dict[str, Any]:
    rows = workload_rows(name, args.n, args.seq, args.saturated_rows)
    # Underfilled: the engine's default budget (every adapter's row fits one micro-batch);
    # saturated: one adapter's rows are exactly one micro-batch.
    budget = args.micro_batch_tokens if name == "underfilled" else rows * args.seq
    engines = {arm: make_engine(args, arm, budget) for arm in ARMS}
    batches = {arm: make_rows(engines[arm], rows, args.seq, seed=7) for arm in ARMS}
    for arm in ARMS:  # untimed first step (allocations, first-call costs)
        time_step(engines[arm], *batches[arm])
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    cpu: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for i in range(args.steps):
        for arm in ARMS if i % 2 == 0 else ARMS[::-1]:
            wall, used = time_step(engines[arm], *batches[arm])
            times[arm].append(wall)
            cpu[arm].append(used)
    med = {arm: statistics.median(times[arm]) for arm in ARMS}
    med_cpu = {arm: statistics.median(cpu[arm]) for arm in ARMS}
    for eng in engines.values():
        eng.close()
    row = {
        "workload": name,
        "n": args.n,
        "rows_per_adapter": rows,
        "seq_tokens": args.seq,
        "micro_batch_tokens": budget,
        "fused_s": med["fused"],
        "timesliced_s": med["timesliced"],
        "fused_vs_timesliced": med["timesliced"] / med["fused"],
        "fused_cpu_s": med_cpu["fused"],
        "timesliced_cpu_s": med_cpu["timesliced"],
        "fused_vs_timesliced_cpu": med_cpu["timesliced"] / med_cpu["fused"],
        "steps": times,
        "steps_cpu": cpu,
    }
    print(
        f"{name:<11} N={args.n} rows/adapter {rows:>3} x {args.seq} tok, micro-batch"
        f" {budget:>5}: wall fused {med['fused']:.3f}s timesliced {med['timesliced']:.3f}s"
        f" -> {row['fused_vs_timesliced']:.2f}x; CPU fused {med_cpu['fused']:.3f}s"
        f" timesliced {med_cpu['timesliced']:.3f}s -> {row['fused_vs_timesliced_cpu']:.2f}x",
        flush=True,
    )
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="bench", choices=["tiny", "bench"])
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--seq", type=int, default=64, help="tokens per row (half prompt)")
    p.add_argument("--saturated-rows", type=int, default=8)
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--steps", type=int, default=11)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--workloads", default="underfilled,saturated")
    p.add_argument("--device", default="cpu", help="cpu or cuda (bench/gpu_device.sh)")
    p.add_argument(
        "--into",
        default=None,
        metavar="KEY",
        help="write the result under KEY of the JSON object already at --out (the device "
        "check brings back 8 files at most)",
    )
    p.add_argument("--out", type=Path, default=Path("out/bench/fused-workloads.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    targs = throughput.parse_args([f"--preset={args.preset}"])
    if not (targs.model_dir / "config.json").exists():
        from loraplex_engine.dev.tiny_model import build_model

        build_model(targs.model_dir, preset=args.preset)
    load_start = os.getloadavg()
    table: list[dict[str, Any]] = []
    for name in args.workloads.split(","):
        table.append(run_workload(args, name))
        write(args, targs, load_start, table)


def write(args: argparse.Namespace, targs: Any, load_start: Any, table: list[Any]) -> None:
    """(Re)write ``--out`` with the workloads measured so far."""
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": throughput.model_info(targs.model_dir),
        "torch_threads": args.threads,
        "device": args.device,
        "machine_start": {**throughput.machine_info(), "loadavg": list(load_start)},
        "machine_end": throughput.machine_info(),
        "workloads": table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.into:
        whole = json.loads(args.out.read_text()) if args.out.exists() else {}
        result = {**whole, args.into: result}
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
