"""One benchmark process: load the base model, train the given experiments to the end, exit.

    python bench/worker.py JOB.json RESULT.json

``JOB.json``: ``{"model_dir", "mode": "fused"|"timesliced", "threads", "max_rank",
"micro_batch_tokens", "checkpoint_root", "launch_unix", "experiments": [{"id", "spec"}]}``
and optionally ``"rollout_backend"`` (torch|vllm), ``"schedule"`` (sync|pipelined),
``"device"`` (default cpu) and ``"autocast"`` (e.g. ``"bfloat16"``: the
frozen base is cast to it and ticks run under ``torch.autocast``; LoRA weights and Adam
moments stay fp32 — the GPU benchmark's setting).
The sequential-cold arm starts one such process per experiment (one experiment each);
the hot arms start one process for all experiments. Everything from interpreter start to
"engine ready" counts as model load (``launch_unix`` is stamped by the parent just before
it spawns us), so the cold start is measured as a user would pay it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(job_path: str, result_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    threads = int(job["threads"])
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import resource

    import torch

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    from loraplex_engine.engine import Engine
    from loraplex_engine.settings.engine import EngineSettings
    from loraplex_engine.spec.experiment import parse_spec

    experiments = job["experiments"]
    device = job.get("device", "cpu")
    settings = EngineSettings(
        max_adapters=len(experiments),
        max_rank=int(job["max_rank"]),
        checkpoint_root=job["checkpoint_root"],
        train_mode=job["mode"],
        micro_batch_tokens=int(job["micro_batch_tokens"]),
        rollout_backend=job.get("rollout_backend", "torch"),
        schedule=job.get("schedule", "sync"),
    )
    engine = Engine(job["model_dir"], settings, ignore_eos=True, device=device)
    amp = job.get("autocast")  # "bfloat16": frozen base in bf16, LoRA + Adam stay fp32
    if amp:
        dtype = getattr(torch, amp)
        for p in engine.model.base_model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(dtype)
    for exp in experiments:
        name = exp["id"].split(".", 1)[1]
        engine.put_experiment(exp["id"], parse_spec(exp["spec"]), "bench", name)
    ready = time.time()

    phases: dict[str, float] = {}
    rewards: dict[str, list[float]] = {e["id"]: [] for e in experiments}
    versions: dict[str, list[int]] = {e["id"]: [] for e in experiments}
    rollout_tokens = dict.fromkeys(rewards, 0)
    train_tokens = dict.fromkeys(rewards, 0)
    finished: dict[str, float] = {}
    failed: dict[str, str] = {}
    ticks = 0

    def run_tick():
        if not amp:
            return engine.tick()
        with torch.autocast(torch.device(device).type, dtype=getattr(torch, amp)):
            return engine.tick()

    while True:
        report = run_tick()
        if report is None:
            # No work now, but an experiment still running waits for its reward (a plug-in
            # reward is scored beside the tick, --reward-deadline): wait for it, as serve does.
            if any(engine.get_experiment(e).phase == "Running" for e in rewards):
                engine.work_available.wait(0.05)
                continue
            break
        ticks += 1
        now = time.time()
        for phase, seconds in report.phase_seconds.items():
            phases[phase] = phases.get(phase, 0.0) + seconds
        for tick in report.experiments:
            if tick.failed_reason is not None:
                failed[tick.id] = tick.failed_reason
                finished[tick.id] = now
                continue
            rewards[tick.id].append(tick.reward)
            versions[tick.id].append(tick.rollout_version)
            rollout_tokens[tick.id] += tick.rollout_tokens
            train_tokens[tick.id] += tick.train_tokens
        for exp_id in rewards:
            if exp_id not in finished and engine.get_experiment(exp_id).phase != "Running":
                finished[exp_id] = now
    result = {
        "mode": job["mode"],
        "launch_unix": job["launch_unix"],
        "ready_unix": ready,
        "end_unix": time.time(),
        "finished_unix": finished,
        "ticks": ticks,
        "phase_s": phases,
        "rewards": rewards,
        "rollout_versions": versions,
        "rollout_tokens": rollout_tokens,
        "train_tokens": train_tokens,
        "failed": failed,
        "adapters": {e: engine.get_experiment(e).adapter_path for e in rewards},
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_device_bytes": (
            torch.cuda.max_memory_allocated() if torch.device(device).type == "cuda" else 0
        ),
        "torch_threads": torch.get_num_threads(),
    }
    with open(result_path, "w") as f:
        json.dump(result, f)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="One benchmark process (throughput.py starts it).")
    ap.add_argument("job", help="JOB.json: the model, mode and experiments to train")
    ap.add_argument("result", help="RESULT.json: where the timings are written")
    return ap.parse_args()


if __name__ == "__main__":
    args = parse_args()
    main(args.job, args.result)
    # Skip interpreter teardown (seconds for torch + transformers on a loaded machine): a
    # single-tenant trainer that has saved its adapter is done. Favours the cold arm.
    sys.stdout.flush()
    os._exit(0)
