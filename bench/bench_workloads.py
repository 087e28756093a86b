"""The tasks bench/throughput.py's experiments train on (``--workload``).

- ``target-token`` (the default, the published numbers): single-letter coverage, a dense
  reward the random bench model learns in tens of steps.
- ``gsm8k``: generated GSM8K-style problems (docs/workloads.md) scored by the engine's
  math-verify reward plug-in, in a plug-in worker per experiment: long prompts (~160
  tokens on the tiny tokenizers) and a reward that crosses a process boundary.
- ``gsm8k-calc``: the same problems through the gsm8k-calculator environment (multi-turn;
  episodes of up to ``CALC_TURNS`` turns, each a rollout batch of its own).

Each experiment ``i`` gets a different problem mix (steps 1..2+i%3) so no two are alike.
"""

from __future__ import annotations

from typing import Any

WORKLOADS = ("target-token", "gsm8k", "gsm8k-calc")
# Single-letter targets: coverage = share of the completion's characters that are the
# letter, so a random policy already scores a few percent (dense signal) and the 13M
# random model learns within tens of steps at 8 rows per step (whole-word targets stay
# at ~0 for 20 steps with so few rows: no group has a nonzero advantage).
TARGETS = ("a", "e", "o", "s", "t", "n", "i", "r")
CALC_TURNS = 3


def task_spec(workload: str, i: int, max_new_tokens: int) -> dict[str, Any]:
    """Experiment ``i``'s ``spec.task``."""
    if workload == "target-token":
        return {"name": "target-token", "params": {"target": TARGETS[i % len(TARGETS)]}}
    params = {"minSteps": "1", "maxSteps": str(2 + i % 3)}
    if workload == "gsm8k":
        return {"name": "gsm8k", "params": params, "reward": "math-verify"}
    if workload == "gsm8k-calc":
        env = {
            "name": "gsm8k-calculator",
            "maxTurns": CALC_TURNS,
            "maxEpisodeTokens": CALC_TURNS * (max_new_tokens + 16),
        }
        return {"name": "gsm8k", "params": {**params, "hint": "false"}, "environment": env}
    raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")


def describe(workload: str) -> str:
    """The workload as results.json records it."""
    return {
        "target-token": "target-token (coverage reward), targets " + ", ".join(TARGETS),
        "gsm8k": "gsm8k (generated, 1..2+i%3 steps), math-verify reward plug-in",
        "gsm8k-calc": f"gsm8k through the gsm8k-calculator environment (<= {CALC_TURNS} turns)",
    }[workload]
