"""Backend-neutral rollout request/result types. (Not named types.py: the vLLM worker runs
with this folder on sys.path, where that name would shadow the standard library.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class RowSink(Protocol):
    """Where a backend that decodes step by step reports a row's tokens as they come.

    Called from the decoding thread: ``push`` must not block (the whole batch waits).
    A row whose ``cancelled()`` turns true stops decoding at once (its client left)."""

    def push(self, token_id: int, logprob: float, top: dict[int, float] | None) -> None: ...

    def cancelled(self) -> bool: ...


@dataclass
class RolloutRequest:
    """One sequence to generate: which adapter slot, which prompt, how to sample.

    Requests that share a ``generator`` (one per experiment) take their randomness from
    it alone (the torch rollout draws one seed from it per micro-batch,
    rollout/torch/sampling.py; vLLM one per call), so an experiment's rollouts do not
    depend on who else is batched.
    """

    slot: int
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    generator: torch.Generator | None = None
    group: str = ""  # experiment id; rows of one group sample together
    adapter: str | None = None  # adapter name for backends that address adapters by name
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens with this mass
    top_k: int = 0  # sample among the k most likely tokens (0 or less: all)
    top_logprobs: int = 0  # alternatives to report per sampled token (0: none)
    seeded: bool = False  # the generator is this request's own seed: sample it alone
    # Seed this row even where seeding costs speed (vLLM on GPU): spec.rollout.reproducible
    reproducible: bool = False
    sink: RowSink | None = None  # per-token reports (serving); None for training rows


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token under the sampling distribution
    nonfinite: bool = False  # the adapter produced NaN/inf logits: the row is garbage
    # per sampled token, the request's top_logprobs most likely tokens -> log-prob
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str = "length"  # "stop": end of sequence; "cancelled": its client left
    # The backend refused or failed this row (vLLM: its request); fails its experiment alone
    error: str | None = None
    # Per token, 1 where the policy sampled it, 0 where an environment's observation sits
    # (a multi-turn episode, environments/episodes.py): trained on the 1s only. None: all 1.
    mask: list[int] | None = None
