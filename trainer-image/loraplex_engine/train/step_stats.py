"""What one experiment's step looked like beyond its mean reward: the spread of its
rewards, how long its completions were, and how uncertain its sampler was. Pure: the tick
records them on its ExperimentTick (spec/api_types.py), for the experiment trackers
(tracking/) and the local runner's summary."""

from __future__ import annotations

import math
from collections.abc import Sequence

from loraplex_engine.rollout.base import Completion


def rollout_stats(rewards: Sequence[float], completions: Sequence[Completion]) -> dict[str, float]:
    """``reward_std``: the population standard deviation of the step's rewards;
    ``response_tokens``: the mean completion length in tokens; ``entropy``: the sampled-token
    estimate of the sampling policy's per-token entropy, -mean log p over every sampled token
    (an unbiased estimate of H = -E[log p] without the full distribution, which neither
    backend keeps). Entropy is left out where no token was sampled or a log-prob is not
    finite (a sampled token the sampler found impossible)."""
    out: dict[str, float] = {}
    if rewards:
        mean = sum(rewards) / len(rewards)
        out["reward_std"] = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))
    if completions:
        out["response_tokens"] = sum(len(c.token_ids) for c in completions) / len(completions)
    logprobs = [lp for c in completions for lp in c.logprobs]
    if logprobs and all(math.isfinite(lp) for lp in logprobs):
        out["entropy"] = -sum(logprobs) / len(logprobs)
    return out
