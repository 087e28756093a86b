"""Markdown tables (medians over repeats) from a throughput results.json.

.venv/bin/python bench/report.py bench/results/cpu-bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ARMS = ("sequential_cold", "hot_timesliced", "hot_fused")


def tables(results: dict) -> str:
    runs = results["runs"]
    cells = sorted({(r["steps"], r["n"]) for r in runs})
    lines = [
        "| steps | N | arm | makespan s | exp/h | mean completion s | model load s "
        "| rollout s | train s | rollout / train tokens | final reward | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for steps, n in cells:
        for arm in ARMS:
            sel = [r for r in runs if (r["arm"], r["n"], r["steps"]) == (arm, n, steps)]
            if not sel:
                continue

            def med(key: str, sub: str | None = None, sel=sel) -> float:
                return statistics.median(r[key][sub] if sub else r[key] for r in sel)

            # Equal across arms within each repeat (with --seed-per-repeat the prompts,
            # hence train tokens, change from one repeat to the next).
            cell = [r for r in runs if (r["n"], r["steps"]) == (n, steps)]
            same = all(
                len({(r["rollout_tokens"], r["train_tokens"]) for r in cell if r["repeat"] == k})
                == 1
                for k in {r["repeat"] for r in cell}
            )
            tok = f"{med('rollout_tokens'):.0f}/{med('train_tokens'):.0f}" if same else "differ!"
            lines.append(
                f"| {steps} | {n} | {arm} | {med('makespan_s'):.1f} "
                f"| {3600 * n / med('makespan_s'):.0f} | {med('mean_completion_s'):.1f} "
                f"| {med('model_load_s'):.1f} | {med('phase_s', 'rollout'):.1f} "
                f"| {med('phase_s', 'train'):.1f} | {tok} | {med('final_reward_mean'):.3f} "
                f"| {med('peak_rss_bytes') / 2**20:.0f} |"
            )
    lines += [
        "",
        "| steps | N | fused vs sequential | … excl. model load | cold-start share of sequential "
        "| fused vs time-sliced | train phase fused vs time-sliced |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results["ratios"], key=lambda r: (r["steps"], r["n"])):
        seq = [
            x
            for x in runs
            if (x["arm"], x["n"], x["steps"]) == ("sequential_cold", r["n"], r["steps"])
        ]
        share = statistics.median(x["model_load_s"] / x["makespan_s"] for x in seq)
        lines.append(
            f"| {r['steps']} | {r['n']} | {r['fused_vs_sequential']:.2f} "
            f"| {r['fused_vs_sequential_excl_load']:.2f} | {share:.0%} "
            f"| {r['fused_vs_timesliced']:.2f} | {r['train_phase_fused_vs_timesliced']:.2f} |"
        )
    parity = results["reward_parity"]
    ok = sum(p["within_2se"] for p in parity)
    lines += [
        "",
        f"Reward parity (fused vs sequential, last-k mean within 2 SE): {ok}/{len(parity)}",
    ]
    bad = [p for p in parity if not p["within_2se"]]
    for p in bad:
        lines.append(
            f"- outside: N={p['n']} steps={p['steps']} {p['experiment']}: sequential "
            f"{p['sequential_last_k_mean']:.3f}, fused {p['fused_last_k_mean']:.3f}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description="Markdown tables from a throughput results.json.")
    ap.add_argument("results", type=Path, help="the results.json bench/throughput.py wrote")
    print(tables(json.loads(ap.parse_args().results.read_text())))


if __name__ == "__main__":
    main()
