"""Rows → vLLM requests, and back: one request per prompt with ``n`` samples.

The tick asks for rows (one per completion: a prompt repeated ``groupSize`` times). vLLM
takes one request per prompt with ``SamplingParams(n=k)``: it computes the prompt once
and forks ``k`` sequences from it. :func:`plan_requests` groups the rows of one
experiment that share a prompt and sampling settings into such a request, remembering
which rows its ``k`` completions answer, in order; :func:`rows_from` maps the results
back. Pure (no vLLM, no process): unit-tested on its own.

Seeds. vLLM samples a request that has a ``seed`` with its own ``torch.Generator``. On
GPU that is a per-request path (vLLM 0.32, ``TopKTopPSampler.forward_cuda``): a batch
holding any seeded row skips FlashInfer's sampler, and each seeded row draws its noise
in its own kernel launch, so a request is seeded only where that is wanted:

- a served completion that names a ``seed`` (the client asked for it);
- an experiment with ``spec.rollout.reproducible: true`` (it asked for it);
- every experiment row when vLLM runs on the CPU (``seed_all``): its sampler draws a
  seed per row and step anyway (``forward_cpu``), a seeded row costs one draw more.

A seeded request's seed is drawn from its experiment's (or job's) own generator, in the
order of that experiment's requests, so it follows from ``algorithm.seed`` and the
generator state a checkpoint saves, whoever else shares the batch; vLLM gives the
request's ``k`` samples ``seed + 0 .. seed + k - 1``. Unseeded requests draw from vLLM's
process-wide RNG: their samples depend on the batch and are not reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from loraplex_engine.rollout.base import Completion, RolloutRequest

SEED_BOUND = 2**31 - 1  # vLLM adds up to n-1 to a seed; torch takes any 64-bit one


@dataclass(frozen=True)
class VLLMRequest:
    """One vLLM request: one adapter and prompt, sampled ``n = len(rows)`` times."""

    rows: tuple[int, ...]  # the rows its completions answer, completion j -> rows[j]
    group: str  # the experiment id ("~job" for served completions)
    adapter: str | None
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_logprobs: int
    seed: int | None = None

    @property
    def n(self) -> int:
        return len(self.rows)

    def wire(self) -> dict[str, Any]:
        """The worker's per-request fields (vllm_worker.Worker.generate)."""
        return {
            "adapter": self.adapter,
            "prompt": list(self.prompt_ids),
            "n": self.n,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_logprobs": self.top_logprobs,
            "seed": self.seed,
        }


def _key(req: RolloutRequest) -> tuple[Any, ...]:
    """Rows that one request can answer: one experiment, adapter, prompt and sampling
    setting; a served completion with its own seed never merges with another."""
    own = id(req.generator) if req.seeded else 0
    return (
        req.group,
        req.adapter,
        tuple(req.prompt_ids),
        req.temperature,
        req.max_new_tokens,
        req.top_p,
        req.top_logprobs,
        req.reproducible,
        own,
    )


def wants_seed(req: RolloutRequest, *, seed_all: bool) -> bool:
    """Whether this row's request is seeded (see the module docstring)."""
    if req.generator is None:
        return False
    return req.seeded or req.reproducible or seed_all


def plan_requests(requests: Sequence[RolloutRequest], *, seed_all: bool) -> list[VLLMRequest]:
    """Group rows into vLLM requests, in order of each request's first row; seeded ones
    draw their seed from their rows' generator now, in that order."""
    rows: dict[tuple[Any, ...], list[int]] = {}
    for i, req in enumerate(requests):
        rows.setdefault(_key(req), []).append(i)
    plan = []
    for members in rows.values():
        first = requests[members[0]]
        seed = None
        if wants_seed(first, seed_all=seed_all):
            assert first.generator is not None
            seed = int(torch.randint(0, SEED_BOUND, (1,), generator=first.generator))
        plan.append(
            VLLMRequest(
                rows=tuple(members),
                group=first.group,
                adapter=first.adapter,
                prompt_ids=list(first.prompt_ids),
                max_new_tokens=first.max_new_tokens,
                temperature=first.temperature,
                top_p=first.top_p,
                top_logprobs=first.top_logprobs,
                seed=seed,
            )
        )
    return plan


@dataclass(frozen=True)
class RequestResult:
    """What the worker answered for one request: its ``n`` completions, or why not."""

    completions: list[Completion]
    error: str | None = None


def failed(error: str) -> RequestResult:
    return RequestResult([], error)


def rows_from(
    plan: Sequence[VLLMRequest], results: Sequence[RequestResult], n_rows: int
) -> list[Completion]:
    """Each row's completion; every row of a refused request carries its error."""
    out: list[Completion | None] = [None] * n_rows
    for req, result in zip(plan, results, strict=True):
        if result.error is not None:
            for row in req.rows:
                out[row] = Completion([], [], finish_reason="error", error=result.error)
            continue
        if len(result.completions) != req.n:
            raise ValueError(f"a request of n={req.n} came back with {len(result.completions)}")
        for row, comp in zip(req.rows, result.completions, strict=True):
            out[row] = comp
    missing = [i for i, c in enumerate(out) if c is None]
    if missing:
        raise ValueError(f"rows {missing[:5]} are in no request")
    return [c for c in out if c is not None]


def by_group(plan: Sequence[VLLMRequest]) -> dict[str, list[int]]:
    """Request indices per experiment, in order: what one experiment's retry resends."""
    groups: dict[str, list[int]] = {}
    for i, req in enumerate(plan):
        groups.setdefault(req.group, []).append(i)
    return groups
