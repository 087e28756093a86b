"""Experiment throughput: sequential cold vs hot time-sliced vs hot fused (issue 7).

    .venv/bin/python bench/throughput.py [--preset bench] [--ns 1,2,4,8] [--steps 10,50]
                                         [--repeats 3] [--threads 1] [--out out/bench]

Three arms run the same N experiments (target-token RL with distinct seeds, targets and
learning rates; same steps, prompts, group size, LoRA config; rollouts generate exactly
``maxNewTokens`` because the workers ignore EOS, so token counts are equal across arms):

- ``sequential_cold``: per experiment, a fresh process loads the base, trains that adapter
  alone (its own rollouts), saves it and exits; the next one starts after it.
- ``hot_timesliced``: one process, base loaded once, mixed-adapter rollouts, training one
  adapter at a time with the others' weights and Adam moments swapped out to host buffers
  by real copies (``Engine(train_mode="timesliced")``), the published design.
- ``hot_fused``: one process, mixed rollouts, one fused forward/backward
  (``Engine(train_mode="fused")``).
- ``pipelined`` (issue 32; not run unless named in ``--arms``): ``hot_fused`` under
  ``--schedule pipelined`` (docs/design/pipeline.md): one cohort trains while the
  others' rollouts generate; every experiment on-policy (``maxStaleness`` 0). With
  ``--rollout-backend vllm`` every arm samples with vLLM in its own process
  (``$LORAPLEX_VLLM_PYTHON``, default ``.venv-vllm/bin/python``), where the overlap is.
- ``pipelined_stale`` (likewise opt-in): ``pipelined`` with ``maxStaleness`` 1 and TIS
  (cap 2): every experiment generates its next rollout while its update is made, so all
  generate and all train in every tick (one step stale, corrected by TIS).

Arms are interleaved per cell and repeat (ABC, CBA, ...) after a warm-up round, and every
process is a fresh interpreter with fixed torch threads. Writes ``results.json``,
``throughput.png`` and ``rewards.png`` under ``--out``. Ratios are of medians over repeats;
> 1 means fused is faster.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_workloads import WORKLOADS, describe, task_spec

ARMS = ("sequential_cold", "hot_timesliced", "hot_fused", "pipelined", "pipelined_stale")
DEFAULT_ARMS = ARMS[:3]
MODES = {
    "hot_timesliced": "timesliced",
    "hot_fused": "fused",
    "pipelined": "fused",
    "pipelined_stale": "fused",
}
SCHEDULES = {"pipelined": "pipelined", "pipelined_stale": "pipelined"}  # the others: sync
# pipelined_stale's experiments: the next rollout may start before the update lands.
STALE_ALGORITHM = {"maxStaleness": 1, "offPolicyCorrection": "tis", "tisCap": 2.0}
PHASES = ("rollout", "reward", "train", "sync")
WORKER = Path(__file__).resolve().with_name("worker.py")
REPO = Path(__file__).resolve().parents[1]


# ---- experiments ----------------------------------------------------------------------


def experiment_specs(
    n: int, steps: int, args: argparse.Namespace, repeat: int = 0
) -> list[dict[str, Any]]:
    """N distinct experiments: seed i, target i, lr spread ±20 % around --lr.

    With ``--seed-per-repeat`` every repeat gets fresh seeds (the same in every arm), so
    the reward-parity test pools independent trajectories instead of one replayed three
    times (runs are deterministic given the seed)."""
    spread = (1.0, 0.8, 1.2, 0.9, 1.1, 0.85, 1.15, 0.95)
    out = []
    for i in range(n):
        spec = {
            "lora": {"rank": args.rank, "alpha": 2 * args.rank, "targetModules": args.targets},
            "task": task_spec(args.workload, i, args.max_new_tokens),
            "algorithm": {
                "groupSize": args.group,
                "promptsPerStep": args.prompts,
                "learningRate": round(args.lr * spread[i % len(spread)], 6),
                "maxSteps": steps,
                "seed": 1000 + i + (100 * repeat if args.seed_per_repeat else 0),
            },
            "rollout": {"maxNewTokens": args.max_new_tokens, "temperature": 1.0},
            "checkpoint": {"everySteps": 10_000, "keep": 1},  # one save, at the end
        }
        out.append({"id": f"bench.exp{i}", "spec": spec})
    return out


# ---- running one arm ------------------------------------------------------------------


def _spawn(job: dict[str, Any], workdir: Path, tag: str) -> dict[str, Any]:
    job_path, result_path = workdir / f"{tag}.job.json", workdir / f"{tag}.result.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"]), "TOKENIZERS_PARALLELISM": "false"}
    if job.get("rollout_backend") == "vllm":
        env.setdefault("LORAPLEX_VLLM_PYTHON", str(REPO / ".venv-vllm" / "bin" / "python"))
    job["launch_unix"] = time.time()  # the cold start counts from here
    job_path.write_text(json.dumps(job))
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(job_path), str(result_path)],
        env=env,
        capture_output=True,
        text=True,
    )
    exit_unix = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"worker {tag} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(result_path.read_text())
    result["exit_unix"] = exit_unix
    return result


def run_arm(
    arm: str, exps: list[dict[str, Any]], args: argparse.Namespace, workdir: Path
) -> dict[str, Any]:
    """One arm on one cell; returns the merged measurements (not yet a results row)."""
    base_job = {
        "model_dir": str(args.model_dir),
        "threads": args.threads,
        "max_rank": args.rank,
        "micro_batch_tokens": args.micro_batch_tokens,
        "checkpoint_root": str(workdir / arm / "checkpoints"),
        "device": args.device,
        "autocast": args.autocast,
        "rollout_backend": args.rollout_backend,
        "schedule": SCHEDULES.get(arm, "sync"),
    }
    if arm == "pipelined_stale":
        exps = [_with_algorithm(e, STALE_ALGORITHM) for e in exps]
    if arm == "sequential_cold":
        results = [
            _spawn({**base_job, "mode": "fused", "experiments": [e]}, workdir, f"{arm}-{i}")
            for i, e in enumerate(exps)
        ]
    else:
        results = [_spawn({**base_job, "mode": MODES[arm], "experiments": exps}, workdir, arm)]
    start = results[0]["launch_unix"]
    finished: dict[str, float] = {}
    for r in results:
        for exp_id in r["rewards"]:
            # Sequential: an experiment is done when its process has saved and exited.
            done = r["exit_unix"] if arm == "sequential_cold" else r["finished_unix"][exp_id]
            finished[exp_id] = done - start
    merged: dict[str, Any] = {
        "makespan_s": results[-1]["exit_unix"] - start,
        "mean_completion_s": statistics.fmean(finished.values()),
        "model_load_s": sum(r["ready_unix"] - r["launch_unix"] for r in results),
        "phase_s": {p: sum(r["phase_s"].get(p, 0.0) for r in results) for p in PHASES},
        "rollout_tokens": sum(sum(r["rollout_tokens"].values()) for r in results),
        "train_tokens": sum(sum(r["train_tokens"].values()) for r in results),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in results),
        "peak_device_bytes": max(r.get("peak_device_bytes", 0) for r in results),
        "rewards": {k: v for r in results for k, v in r["rewards"].items()},
        # Per experiment, the largest staleness of a step (step - 1 - its rollout's version).
        "max_staleness": max(
            (
                i - v
                for r in results
                for vs in r.get("rollout_versions", {}).values()
                for i, v in enumerate(vs)
            ),
            default=0,
        ),
        "failed": {k: v for r in results for k, v in r["failed"].items()},
    }
    shutil.rmtree(workdir / arm, ignore_errors=True)
    return merged


def _with_algorithm(exp: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    spec = {**exp["spec"], "algorithm": {**exp["spec"]["algorithm"], **fields}}
    return {**exp, "spec": spec}


def last_k(steps: int) -> int:
    return max(2, min(5, steps // 2))


# ---- summarising ----------------------------------------------------------------------


def _median(runs: list[dict[str, Any]], key: str, sub: str | None = None) -> float:
    values = [r[key][sub] if sub else r[key] for r in runs]
    return statistics.median(values)


def ratios(runs: list[dict[str, Any]], cells: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """Per cell, each arm's median makespan over another's (> 1: the second is faster),
    for the arms that ran; ``_excl_load`` ratios leave each process's model load (and the
    vLLM worker's start) out."""
    out = []
    for n, steps in cells:
        by = {a: [r for r in runs if (r["arm"], r["n"], r["steps"]) == (a, n, steps)] for a in ARMS}
        row: dict[str, Any] = {"n": n, "steps": steps}

        for name, slow, fast in (
            ("fused_vs_sequential", "sequential_cold", "hot_fused"),
            ("fused_vs_timesliced", "hot_timesliced", "hot_fused"),
            ("pipelined_vs_fused", "hot_fused", "pipelined"),
            ("pipelined_stale_vs_fused", "hot_fused", "pipelined_stale"),
        ):
            if by[slow] and by[fast]:
                row[name] = _median(by[slow], "makespan_s") / _median(by[fast], "makespan_s")
                row[name + "_excl_load"] = _excl_load(by[slow]) / _excl_load(by[fast])
                if name.startswith("pipelined"):  # per repeat: the arms ran back to back
                    row[name + "_excl_load_per_repeat"] = [
                        _excl_load([a]) / _excl_load([b])
                        for a, b in zip(by[slow], by[fast], strict=False)
                    ]
        if by["hot_timesliced"] and by["hot_fused"]:
            row["train_phase_fused_vs_timesliced"] = _median(
                by["hot_timesliced"], "phase_s", "train"
            ) / _median(by["hot_fused"], "phase_s", "train")
        if len(row) > 2:
            out.append(row)
    return out


def _excl_load(runs: list[dict[str, Any]]) -> float:
    return statistics.median(r["makespan_s"] - r["model_load_s"] for r in runs)


def _mean_se(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, statistics.stdev(values) / math.sqrt(len(values))


PARITY_PAIRS = (
    ("sequential_cold", "hot_fused"),
    ("hot_fused", "pipelined"),
    ("hot_fused", "pipelined_stale"),
)


def reward_parity(
    curves: dict[tuple[str, int, int], dict[str, list[list[float]]]],
    cells: list[tuple[int, int]],
) -> list[dict[str, Any]]:
    """Per experiment: last-k mean reward of two arms (sequential vs fused, fused vs
    pipelined), pooled over repeats.

    Within 2 SE: |difference| <= 2 * sqrt(se_a^2 + se_b^2), where each SE is that of
    the pooled last-k step rewards (k = min(5, steps // 2)).
    """
    out = []
    for a, b in PARITY_PAIRS:
        for n, steps in cells:
            first = curves.get((a, n, steps), {})
            second = curves.get((b, n, steps), {})
            k = last_k(steps)
            for exp_id in sorted(set(first) & set(second)):
                a_vals = [x for c in first[exp_id] for x in c[-k:]]
                b_vals = [x for c in second[exp_id] for x in c[-k:]]
                (ma, sea), (mb, seb) = _mean_se(a_vals), _mean_se(b_vals)
                bound = 2 * math.sqrt(sea**2 + seb**2)
                row = {"n": n, "steps": steps, "experiment": exp_id, "arms": [a, b]}
                # The sequential/fused pair keeps its historical keys.
                names = ("sequential", "fused") if a == "sequential_cold" else (a, b)
                row[f"{names[0]}_last_k_mean"] = ma
                row[f"{names[1]}_last_k_mean"] = mb
                row["within_2se"] = bool(abs(ma - mb) <= bound + 1e-9)
                out.append(row)
    return out


# ---- plots ----------------------------------------------------------------------------


def plot_throughput(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps_list = sorted({r["steps"] for r in results["runs"]})
    fig, axes = plt.subplots(1, len(steps_list), figsize=(5 * len(steps_list), 4), squeeze=False)
    for ax, steps in zip(axes[0], steps_list, strict=True):
        for arm in [a for a in ARMS if any(r["arm"] == a for r in results["runs"])]:
            ns = sorted({r["n"] for r in results["runs"] if r["steps"] == steps})
            ys = []
            for n in ns:
                sel = [
                    r for r in results["runs"] if (r["arm"], r["n"], r["steps"]) == (arm, n, steps)
                ]
                ys.append(3600 * n / statistics.median(r["makespan_s"] for r in sel) if sel else 0)
            ax.plot(ns, ys, marker="o", label=arm)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent experiments N")
        ax.set_ylabel("experiments / hour (median makespan)")
        ax.set_title(f"{steps}-step experiments")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_rewards(
    curves: dict[tuple[str, int, int], dict[str, list[list[float]]]], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(n, s) for (_, n, s) in curves}, key=lambda c: (c[1], c[0]))
    # The largest N of each length: the most tenants batched together.
    shown = [
        max((c for c in cells if c[1] == s), key=lambda c: c[0]) for s in {c[1] for c in cells}
    ]
    shown.sort(key=lambda c: c[1])
    fig, axes = plt.subplots(1, len(shown), figsize=(6 * len(shown), 4), squeeze=False)
    for ax, (n, steps) in zip(axes[0], shown, strict=True):
        colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        seq = curves.get(("sequential_cold", n, steps), {})
        fused = curves.get(("hot_fused", n, steps), {})
        for i, exp_id in enumerate(sorted(fused)):
            c = colours[i % len(colours)]
            ax.plot(fused[exp_id][0], color=c, label=f"{exp_id.split('.')[-1]} fused")
            if exp_id in seq:
                ax.plot(seq[exp_id][0], color=c, linestyle="--", alpha=0.7)
        ax.set_title(f"N={n}, {steps} steps: fused (solid) vs sequential (dashed), repeat 0")
        ax.set_xlabel("step")
        ax.set_ylabel("mean reward")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main -----------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu,
        "loadavg": list(os.getloadavg()),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def model_info(model_dir: Path) -> dict[str, Any]:
    cfg = json.loads((model_dir / "config.json").read_text())
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i
    vocab = cfg["vocab_size"]
    return {
        "dir": str(model_dir),
        "arch": cfg.get("architectures", ["?"])[0],
        "hidden_size": h,
        "intermediate_size": i,
        "layers": layers,
        "vocab_size": vocab,
        "params": layers * per_layer + 2 * vocab * h + (2 * layers + 1) * h,
        "linear_params": layers * per_layer + vocab * h,
    }


def write_results(
    args: argparse.Namespace,
    config: dict[str, Any],
    runs: list[dict[str, Any]],
    curves: dict[tuple[str, int, int], dict[str, list[list[float]]]],
    cells: list[tuple[int, int]],
    device_peaks: list[dict[str, Any]],
    t0: float,
    complete: bool,
) -> dict[str, Any]:
    """(Re)write results.json and curves.json; ``config.complete`` says if the grid is done."""
    config = {**config, "complete": complete, "wall_s": time.time() - t0}
    config["machine_end"] = machine_info()
    results = {
        "config": config,
        "runs": runs,
        "ratios": ratios(runs, cells),
        "reward_parity": reward_parity(curves, cells),
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    (args.out / "curves.json").write_text(
        json.dumps({f"{a}/{n}/{s}": v for (a, n, s), v in curves.items()})
    )
    if args.device != "cpu":
        (args.out / "device_memory.json").write_text(json.dumps(device_peaks, indent=1))
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="bench", choices=["tiny", "bench"])
    p.add_argument("--workload", default="target-token", choices=WORKLOADS)
    p.add_argument(
        "--model-dir", type=Path, default=None, help="default .cache/models/<preset>-llama"
    )
    p.add_argument("--ns", default="1,2,4,8")
    p.add_argument("--steps", default="10,50", help="experiment lengths (short,long)")
    p.add_argument(
        "--long-ns",
        default=None,
        help="N values run for lengths other than the first (default all)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds (N=1, 2 steps) first")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--group", type=int, default=4, help="GRPO group size")
    p.add_argument("--prompts", type=int, default=2, help="prompts per step per experiment")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", default="q_proj,v_proj,lm_head")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"of {', '.join(ARMS)}")
    p.add_argument(
        "--rollout-backend", default="torch", choices=["torch", "vllm"], help="every arm's"
    )
    p.add_argument(
        "--seed-per-repeat",
        action="store_true",
        help="seeds 1000+i+100*repeat instead of 1000+i (independent trajectories per repeat)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--autocast", default=None, help="e.g. bfloat16 (GPU benchmark)")
    p.add_argument("--out", type=Path, default=Path("out/bench"))
    args = p.parse_args(argv)
    args.ns = [int(x) for x in args.ns.split(",")]
    args.steps = [int(x) for x in args.steps.split(",")]
    args.long_ns = [int(x) for x in args.long_ns.split(",")] if args.long_ns else args.ns
    args.targets = args.targets.split(",")
    args.arms = [a for a in args.arms.split(",") if a]
    if args.model_dir is None:
        args.model_dir = REPO / ".cache" / "models" / f"{args.preset}-llama"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not (args.model_dir / "config.json").exists():
        from loraplex_engine.dev.tiny_model import build_model

        build_model(args.model_dir, preset=args.preset)
    args.out.mkdir(parents=True, exist_ok=True)
    cells = [(n, s) for s in args.steps for n in (args.ns if s == args.steps[0] else args.long_ns)]
    config = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": model_info(args.model_dir),
        "preset": args.preset,
        "ns": args.ns,
        "steps": args.steps,
        "long_ns": args.long_ns,
        "repeats": args.repeats,
        "warmup_rounds": args.warmup,
        "torch_threads_per_process": args.threads,
        "arms": args.arms,
        "interleave": "per repeat and cell, arm order alternates forward/reverse",
        "experiment": {
            "task": describe(args.workload),
            "group_size": args.group,
            "prompts_per_step": args.prompts,
            "rows_per_step_per_experiment": args.group * args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "ignore_eos": True,
            "lora": {"rank": args.rank, "alpha": 2 * args.rank, "targetModules": args.targets},
            "lr": f"{args.lr} x (1.0, 0.8, 1.2, 0.9, 1.1, 0.85, 1.15, 0.95)[i]",
            "seeds": "1000 + i + 100 * repeat" if args.seed_per_repeat else "1000 + i",
        },
        "micro_batch_tokens": args.micro_batch_tokens,
        "device": args.device,
        "autocast": args.autocast,
        "rollout_backend": args.rollout_backend,
        "reward_last_k": {s: last_k(s) for s in args.steps},
        "machine_start": machine_info(),
    }
    print(f"model {config['model']['params'] / 1e6:.1f}M params, cells {cells}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="loraplex-bench-"))
    t0 = time.time()
    try:
        for _ in range(args.warmup):
            warm = experiment_specs(1, 2, args)
            for arm in args.arms:
                run_arm(arm, warm, args, workdir)
        runs: list[dict[str, Any]] = []
        curves: dict[tuple[str, int, int], dict[str, list[list[float]]]] = {}
        device_peaks: list[dict[str, Any]] = []
        flip = False
        # Short experiments first (all repeats), then long ones: a run cut short still
        # has complete short cells. results.json is rewritten after every run.
        schedule = [
            (repeat, n, steps)
            for length in args.steps
            for repeat in range(args.repeats)
            for n, steps in cells
            if steps == length
        ]
        for repeat, n, steps in schedule:
            exps = experiment_specs(n, steps, args, repeat)
            order = list(reversed(args.arms)) if flip else list(args.arms)
            flip = not flip
            for arm in order:
                load_before = os.getloadavg()[0]  # the shared machine's load at the start
                m = run_arm(arm, exps, args, workdir)
                m["loadavg_1m_start"] = load_before
                rewards = m.pop("rewards")
                failed = m.pop("failed")
                device_bytes = m.pop("peak_device_bytes")
                k = last_k(steps)
                finals = [statistics.fmean(c[-k:]) for c in rewards.values() if c]
                row = {
                    "arm": arm,
                    "n": n,
                    "steps": steps,
                    "repeat": repeat,
                    **m,
                    "final_reward_mean": statistics.fmean(finals) if finals else float("nan"),
                }
                if failed:
                    row["failed"] = failed
                runs.append(row)
                device_peaks.append(
                    {
                        **{k: row[k] for k in ("arm", "n", "steps")},
                        "repeat": repeat,
                        "peak_device_bytes": device_bytes,
                    }
                )
                for exp_id, c in rewards.items():
                    curves.setdefault((arm, n, steps), {}).setdefault(exp_id, []).append(c)
                print(
                    f"[{time.time() - t0:7.1f}s] r{repeat} N={n} steps={steps} {arm:<16}"
                    f" makespan {m['makespan_s']:7.2f}s load {m['model_load_s']:5.2f}s"
                    f" train {m['phase_s']['train']:6.2f}s"
                    f" rollout {m['phase_s']['rollout']:6.2f}s"
                    f" tokens {m['rollout_tokens']}/{m['train_tokens']}"
                    f" reward {row['final_reward_mean']:.3f}",
                    flush=True,
                )
                write_results(args, config, runs, curves, cells, device_peaks, t0, False)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results = write_results(args, config, runs, curves, cells, device_peaks, t0, True)
    plot_throughput(results, args.out / "throughput.png")
    plot_rewards(curves, args.out / "rewards.png")
    for r in results["ratios"]:
        shown = ", ".join(f"{k} {v:.2f}" for k, v in r.items() if isinstance(v, float))
        print(f"N={r['n']} steps={r['steps']}: {shown}")
    parity = results["reward_parity"]
    print(f"reward parity: {sum(p['within_2se'] for p in parity)}/{len(parity)} within 2 SE")
    print(
        f"wrote {args.out}/results.json, throughput.png, rewards.png"
        f" in {results['config']['wall_s']:.0f}s"
    )
    return results


if __name__ == "__main__":
    main()
