"""An eval's numbers and its schedule (pure; docs/evaluation.md).

pass@k is the unbiased estimator of Chen et al. 2021 (HumanEval): of n completions of a
prompt, c passed; the chance that k drawn without replacement hold at least one pass is
``1 - C(n - c, k) / C(n, k)``, averaged over the prompts. With n == k it is the plain
"any of the k passed".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Eval seeds: a stream of their own, so an eval never moves the training samples' RNG
# (sampling.py draws from the experiment's generator) and the same step's eval repeats.
EVAL_SEED_SALT = 0x5EED_E7A1


@dataclass(frozen=True)
class EvalResult:
    """One eval of an adapter: what status, metrics and trackers report."""

    step: int  # the adapter evaluated: after this many optimiser steps
    reward: float  # mean reward over every eval completion (evalReward)
    pass_at_k: float  # mean over prompts of the unbiased pass@k (evalPassAtK)
    k: int
    samples: int  # completions per prompt (n)
    prompts: int
    tokens: int  # prompt + completion tokens the eval's rows cost


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that k of n completions, c of which pass, hold at least one pass."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n (n={n}, c={c}, k={k})")
    if n - c < k:  # every k-subset holds a pass
        return 1.0
    # C(n-c, k) / C(n, k) as a product: no huge integers, exact enough for n <= 16.
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def summarize(
    rewards: Sequence[float], samples: int, k: int, threshold: float, step: int, tokens: int
) -> EvalResult:
    """``rewards``: ``samples`` consecutive ones per prompt, in prompt order."""
    if not rewards or len(rewards) % samples:
        raise ValueError(f"{len(rewards)} eval rewards are not {samples} per prompt")
    groups = [rewards[i : i + samples] for i in range(0, len(rewards), samples)]
    passes = [pass_at_k(samples, sum(r >= threshold for r in g), k) for g in groups]
    return EvalResult(
        step=step,
        reward=sum(rewards) / len(rewards),
        pass_at_k=sum(passes) / len(passes),
        k=k,
        samples=samples,
        prompts=len(groups),
        tokens=tokens,
    )


def eval_due(step: int, every: int, last_planned: int | None, finished: bool) -> bool:
    """Whether the adapter at ``step`` is to be evaluated: at step 0 and every ``every``
    steps, and at the last one (``finished``), each step once (``last_planned``: the step
    of the latest eval planned)."""
    return (step % every == 0 or finished) and last_planned != step


def eval_seed(seed: int, step: int) -> int:
    """The seed of the eval at ``step`` of a run seeded ``seed`` (a non-negative int64)."""
    return (seed * 1_000_003 + step + EVAL_SEED_SALT) % (1 << 63)
