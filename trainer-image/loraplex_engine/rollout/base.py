"""Backend-neutral rollout request/result types. (Not named types.py: the vLLM worker runs
with this folder on sys.path, where that name would shadow the standard library.)"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RolloutRequest:
    """One sequence to generate: which adapter slot, which prompt, how to sample.

    Requests that share a ``generator`` (one per experiment) draw their samples from it
    in request order, so an experiment's rollouts do not depend on who else is batched.
    """

    slot: int
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    generator: torch.Generator | None = None
    group: str = ""  # experiment id; rows of one group sample together
    adapter: str | None = None  # adapter name for backends that address adapters by name


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token under the sampling distribution
    nonfinite: bool = False  # the adapter produced NaN/inf logits: the row is garbage
