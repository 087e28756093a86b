"""What bench/tinker_clock.py makes of its runs (issue 28): each (rows, N)'s throughput
ratio, every client's parity with per_model under the tolerances of the engine's dtype,
the one verdict a reader (or bench/gpu_tinker.py) takes first, the table and the plot.

Parity tolerances, by the dtype the engine ran the frozen base in (serve's default:
float32 on the CPU, bfloat16 on CUDA; adapters and Adam's state are float32 in both):

- ``float32``: at step k (weights after k optimiser steps) ``|L_fused - L_alone| <=
  LOSS_RTOL * |L_k| + STEP_MAX_TOL * |L_0 - L_k|``: the forward's own rounding (fp32 sums
  of ~100 tokens: sqrt(n) * 2^-24 ~ 6e-7, bounded by 1e-5) plus a weight gap of at most
  STEP_MAX_TOL Adam steps per element, whose first-order effect on the loss is at most
  that share of what the k steps moved it (Adam moves every element by up to one step
  against its gradient's sign, so |L_0 - L_k| ~ sum |grad| * lr * k). Adapters:
  tests/support/adapter_parity.py's bounds (RMS <= STEP_RMS_TOL, max <= STEP_MAX_TOL).
- ``bfloat16`` (argued, not yet run on a GPU): fused and per_model run a client's rows in
  batches of different sizes, for which cuBLAS may choose another kernel (tile shape,
  split-K), so a row's fp32 accumulation order differs and, where it straddles a bf16
  rounding boundary, a stored activation differs by one bf16 ulp (2^-7 relative).
  Gradients then differ by a few such ulps in the bulk, and Adam's steps by about that
  share: BF16_STEP_RMS_TOL = 0.1 of a step over an adapter (about 13 ulps; a missing or
  wrong gradient share turns most steps by O(1)). Elements at the rounding floor can
  flip a whole step (Adam divides by ~eps), so the max gap is recorded, not judged. The
  loss: BF16_LOSS_RTOL = 2^-7 (one bf16 ulp of the loss: a loss near log(vocab), from
  logits of std ~0.6 at this random init, moves by a fraction of the logits' relative
  change) plus BF16_STEP_RMS_TOL of what the k steps moved it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.support.adapter_parity import STEP_MAX_TOL, STEP_RMS_TOL, adapter_gap_of_files

LOSS_RTOL = 1e-5
BF16_LOSS_RTOL = 2.0**-7
BF16_STEP_RMS_TOL = 0.1
TOLERANCES: dict[str, dict[str, float | None]] = {
    "float32": {"loss_rtol": LOSS_RTOL, "loss_step_share": STEP_MAX_TOL,
                "adapter_rms_steps": STEP_RMS_TOL, "adapter_max_steps": STEP_MAX_TOL},
    "bfloat16": {"loss_rtol": BF16_LOSS_RTOL, "loss_step_share": BF16_STEP_RMS_TOL,
                 "adapter_rms_steps": BF16_STEP_RMS_TOL, "adapter_max_steps": None},
}  # fmt: skip


def engine_dtype(device: str, dtype: str | None) -> str:
    """The base's dtype serve runs at (settings/engine.py's default when not given)."""
    return dtype or ("bfloat16" if device.startswith("cuda") else "float32")


def parity(fused: dict, per_model: dict, lr: float, steps: int, tol: dict) -> dict:
    """Each client's losses and final adapter, a fused arm vs per_model."""
    out = {}
    for i, ref in per_model["losses"].items():
        got = fused["losses"][i]
        bound = [tol["loss_rtol"] * abs(r) + tol["loss_step_share"] * abs(ref[0] - r)
                 for r in ref]  # fmt: skip
        diff = [abs(a - b) for a, b in zip(ref, got, strict=True)]
        gap = adapter_gap_of_files(
            Path(per_model["adapters"][i]), Path(fused["adapters"][i]), lr, steps
        )
        worst = tol["adapter_max_steps"]
        out[i] = {
            "max_abs_loss_diff": max(diff),
            "max_rel_loss_diff": max(d / abs(r) for d, r in zip(diff, ref, strict=True)),
            "losses_within_tolerance": all(d <= t for d, t in zip(diff, bound, strict=True)),
            "adapter_gap_rms_steps": gap.rms,
            "adapter_gap_max_steps": gap.worst,
            "adapter_within_tolerance": gap.rms <= tol["adapter_rms_steps"]
            and (worst is None or gap.worst <= worst),
        }
    return out


def summarise(runs: list[dict], lr: float, steps: int, tol: dict) -> tuple[list[dict], dict]:
    """Per (rows, N): each arm's median throughput over the repeats that ran both arms
    (a run cut short between the arms of a cell leaves one out) and fused / per_model;
    per (rows, N, repeat): every client's parity with per_model."""
    arms_of: dict[tuple[int, int, int], set[str]] = {}
    for r in runs:
        arms_of.setdefault((r["rows"], r["n"], r["repeat"]), set()).add(r["arm"])
    cells: dict[tuple[int, int], dict[str, list[dict]]] = {}
    for r in runs:
        if arms_of[(r["rows"], r["n"], r["repeat"])] >= {"fused", "per_model"}:
            cells.setdefault((r["rows"], r["n"]), {}).setdefault(r["arm"], []).append(r)
    ratios, parities = [], {}
    for (rows, n), arms in cells.items():
        med = {
            a: {
                k: float(np.median([r[k] for r in rs]))
                for k in ("train_tokens_per_s", "steps_per_s")
            }
            for a, rs in arms.items()
        }
        ratio = med["fused"]["train_tokens_per_s"] / med["per_model"]["train_tokens_per_s"]
        by_repeat = {r["repeat"]: r for r in arms["per_model"]}
        pairs = paired_ratios(arms["fused"], by_repeat)
        ratios.append({"rows": rows, "n": n, "median": med,
                       "fused_vs_per_model": round(ratio, 3),
                       "per_repeat": pairs,
                       "fused_vs_per_model_paired": round(float(np.median(pairs)), 3)})  # fmt: skip
        for f in arms["fused"]:
            if f["repeat"] in by_repeat:
                key = f"rows{rows}-n{n}-{f['repeat']}-fused"
                parities[key] = parity(f, by_repeat[f["repeat"]], lr, steps, tol)
    return ratios, parities


def paired_ratios(fused: list[dict], per_model_by_repeat: dict[int, dict]) -> list[float]:
    """fused / per_model of each repeat: the two arms of a repeat run back to back (in
    turns), so a drift in the machine's speed over the run (a shared host's) cancels in
    the pair and not in the ratio of the two arms' medians."""
    return [
        round(f["train_tokens_per_s"] / per_model_by_repeat[f["repeat"]]["train_tokens_per_s"], 3)
        for f in sorted(fused, key=lambda r: r["repeat"])
        if f["repeat"] in per_model_by_repeat
    ]


def verdict(parities: dict, dtype: str) -> dict[str, Any]:
    """Every client run's parity in one line: how many held, the worst of each measure."""
    every = [v for per in parities.values() for v in per.values()]
    losses = sum(v["losses_within_tolerance"] for v in every)
    adapters = sum(v["adapter_within_tolerance"] for v in every)
    return {
        "dtype": dtype,
        "tolerance": TOLERANCES[dtype],
        "client_runs": len(every),
        "losses_within": losses,
        "adapters_within": adapters,
        "ok": bool(every) and losses == adapters == len(every),
        "max_rel_loss_diff": max((v["max_rel_loss_diff"] for v in every), default=None),
        "adapter_gap_rms_steps_max": max((v["adapter_gap_rms_steps"] for v in every), default=None),
        "adapter_gap_max_steps": max((v["adapter_gap_max_steps"] for v in every), default=None),
    }


def ratio_by_rows(ratios: list[dict]) -> dict[str, dict[str, float]]:
    """``{"rows 1": {"8": fused / per_model, ...}, ...}``: what a reader looks up first."""
    out: dict[str, dict[str, float]] = {}
    for r in ratios:
        out.setdefault(f"rows {r['rows']}", {})[str(r["n"])] = r["fused_vs_per_model"]
    return out


def print_table(ratios: list[dict], summary: dict) -> None:
    print(
        "\n| rows | N | fused tok/s | fused steps/s | per_model tok/s | per_model steps/s "
        "| fused / per_model | paired |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in ratios:
        f, s = r["median"]["fused"], r["median"]["per_model"]
        print(
            f"| {r['rows']} | {r['n']} | {f['train_tokens_per_s']:.0f} | "
            f"{f['steps_per_s']:.1f} | {s['train_tokens_per_s']:.0f} | "
            f"{s['steps_per_s']:.1f} | {r['fused_vs_per_model']} | "
            f"{r['fused_vs_per_model_paired']} |"
        )
    if summary["client_runs"]:
        print(f"parity ({summary['dtype']}): {summary['losses_within']}/"
              f"{summary['client_runs']} client runs' losses and {summary['adapters_within']} "
              f"adapters within tolerance; max rel loss diff "
              f"{summary['max_rel_loss_diff']:.1e}; adapter gap max "
              f"{summary['adapter_gap_max_steps']:.1e} Adam steps")  # fmt: skip


def plot(report: dict, path: Path) -> None:
    """Every client's loss curve at the largest N, per batch size (repeat 0): fused solid,
    per_model dashed on top of it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not report["runs"]:
        return
    n = max(r["n"] for r in report["runs"])
    rows = sorted({r["rows"] for r in report["runs"]})
    row_tokens = report["config"]["prompt_tokens"] + report["config"]["completion_tokens"] - 1
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 3.8), squeeze=False)
    for ax, size in zip(axes[0], rows, strict=True):
        for run in report["runs"]:
            if (run["n"], run["rows"], run["repeat"]) != (n, size, 0):
                continue
            style = "-" if run["arm"] == "fused" else "--"
            for i, losses in run["losses"].items():
                ax.plot(range(len(losses)), losses, style, color=f"C{int(i)}",
                        label=f"client {i}" if run["arm"] == "fused" else None)  # fmt: skip
        ax.set_title(f"N={n}, {size} row(s) of {row_tokens} tokens a step")
        ax.set_xlabel("step")
        ax.set_ylabel("loss per weighted token")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle("Tinker SDK clients' losses: fused (solid) vs per_model (dashed, identical)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
