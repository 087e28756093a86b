"""Where the pipelined schedule's time goes on a shared CPU: CPU seconds of the trainer and
of the vLLM worker per tick, sync vs pipelined, on one engine (issue 32).

    LORAPLEX_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python bench/pipeline_cpu.py \\
        [--ticks 4] [--rounds 2] [--out bench/results/pipeline-cpu.json]

One engine, vLLM in its own process, the throughput benchmark's N=8 experiments with
``maxStaleness`` 1 (so the pipelined tick trains everyone while everyone generates: the
same batches as the sync tick). Its tick alternates between the sync and the pipelined
schedule (``--ticks`` ticks each, ``--rounds`` times): same model, worker and adapters;
a pipelined block starts with one untimed tick (it only generates), so every timed tick
of either schedule makes every experiment's update and generates its next rollout.
Per block: wall seconds, the engine process's CPU seconds (trainer, tick thread and
rollout thread) and the vLLM worker tree's. The overlap can only turn CPU seconds into
fewer wall seconds if a second core is free: ``ideal_pipelined_s`` = max(engine, vLLM)
CPU seconds of the sync blocks is what two free cores would give; the wall seconds say
what this machine's load left.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput


def cpu_seconds(me: psutil.Process) -> tuple[float, float]:
    """(this process, its children) user + system CPU seconds."""
    own = sum(me.cpu_times()[:2])
    kids = 0.0
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # ended since listed
            kids += sum(child.cpu_times()[:2])
    return own, kids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ticks", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("out/bench/pipeline-cpu.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    from loraplex_engine.engine import Engine
    from loraplex_engine.settings.engine import EngineSettings
    from loraplex_engine.spec.experiment import parse_spec
    from loraplex_engine.tick.pipelined import PipelinedTick

    targs = throughput.parse_args(["--preset=bench"])
    if not (targs.model_dir / "config.json").exists():
        from loraplex_engine.dev.tiny_model import build_model

        build_model(targs.model_dir, preset="bench")
    settings = EngineSettings(
        max_adapters=8,
        max_rank=targs.rank,
        checkpoint_root=tempfile.mkdtemp(prefix="pipeline-cpu-"),
        rollout_backend="vllm",
        micro_batch_tokens=targs.micro_batch_tokens,
    )
    eng = Engine(targs.model_dir, settings, ignore_eos=True)
    for e in throughput.experiment_specs(8, 10_000, targs):
        e["spec"]["algorithm"]["maxStaleness"] = 1
        eng.put_experiment(e["id"], parse_spec(e["spec"]), "bench", e["id"][6:])
    sync_tick = eng._tick
    t = sync_tick
    piped = PipelinedTick(
        t.model, t.codec, t.backend, t.strategy, t.store, t.scorer,
        t.max_prompt_tokens, t.context_tokens,
    )  # fmt: skip
    me = psutil.Process()
    eng.tick()  # warm-up
    blocks: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        for name, tick in (("sync", sync_tick), ("pipelined", piped)):
            eng._tick = tick
            piped.lanes.clear()  # a pending rollout would not be the sync tick's
            if tick is piped:  # untimed: its first tick only generates (nothing to train)
                eng.tick()
            load = os.getloadavg()[0]
            own0, kids0 = cpu_seconds(me)
            wall0 = time.perf_counter()
            for _ in range(args.ticks):
                eng.tick()
            own1, kids1 = cpu_seconds(me)
            block = {
                "schedule": name,
                "wall_s": time.perf_counter() - wall0,
                "engine_cpu_s": own1 - own0,
                "vllm_cpu_s": kids1 - kids0,
                "loadavg_1m_start": load,
            }
            blocks.append(block)
            print(json.dumps(block), flush=True)
    eng.close()

    def med(schedule: str, key: str) -> float:
        return statistics.median(b[key] for b in blocks if b["schedule"] == schedule)

    summary = {
        s: {k: med(s, k) for k in ("wall_s", "engine_cpu_s", "vllm_cpu_s")}
        for s in ("sync", "pipelined")
    }
    sync = summary["sync"]
    summary["ideal_pipelined_s"] = max(sync["engine_cpu_s"], sync["vllm_cpu_s"])
    summary["ideal_speedup"] = (sync["engine_cpu_s"] + sync["vllm_cpu_s"]) / summary[
        "ideal_pipelined_s"
    ]
    summary["measured_speedup"] = sync["wall_s"] / summary["pipelined"]["wall_s"]
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "ticks_per_block": args.ticks,
        "machine": throughput.machine_info(),
        "blocks": blocks,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
