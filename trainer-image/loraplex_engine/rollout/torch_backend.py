"""Rollouts through the engine's own multi-LoRA model: one KV-cached batch for all rows.

Sampling is our own loop rather than ``model.generate`` because each row carries its
own adapter, temperature, token limit and random generator; ``generate`` takes one of
each per call.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from loraplex_engine.rollout.base import Completion, RolloutRequest

# (input_ids, attention_mask, position_ids, past_key_values) -> (last logits, past)
ForwardFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, object], tuple[torch.Tensor, object]
]
# slot per row -> context in which the model routes each row to its adapter
RouteFn = Callable[[torch.Tensor], AbstractContextManager[Any]]


def left_pad(prompts: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad so every row's next token sits in the last column."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest set whose mass reaches ``top_p`` (the most
    likely token always stays); the multinomial draw renormalises."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(-1, descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
    return probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))


def _sample_rows(
    logits: torch.Tensor,
    requests: Sequence[RolloutRequest],
    groups: dict[str, list[int]],
    broken: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, dict[int, dict[int, float]]]:
    """Pick one token per row; each group draws from its own generator, in row order.

    Returns the tokens, their log-probs under the temperature-scaled distribution (before
    ``top_p``), and for rows that asked for alternatives their top tokens' log-probs.
    A group whose logits are not finite (a diverged adapter) gets pad tokens and is
    flagged in ``broken`` instead of failing the whole batch.
    """
    tokens = torch.empty(len(requests), dtype=torch.long)
    logprobs = torch.empty(len(requests), dtype=logits.dtype)
    tops: dict[int, dict[int, float]] = {}
    for rows in groups.values():
        index = torch.tensor(rows)
        first = requests[rows[0]]
        if not bool(torch.isfinite(logits[index]).all()):
            broken[index] = True
            tokens[index] = 0
            logprobs[index] = float("nan")
            continue
        if first.temperature <= 0:
            scaled = logits[index].log_softmax(-1)
            chosen = scaled.argmax(-1)
        else:
            scaled = (logits[index] / first.temperature).log_softmax(-1)
            probs = _nucleus(scaled.exp(), first.top_p)
            chosen = torch.multinomial(probs, 1, generator=first.generator).squeeze(-1)
        tokens[index] = chosen
        logprobs[index] = scaled.gather(-1, chosen[:, None]).squeeze(-1)
        if first.top_logprobs > 0:
            values, ids = scaled.topk(first.top_logprobs, dim=-1)
            for i, row in enumerate(rows):
                tops[row] = dict(zip(ids[i].tolist(), values[i].tolist(), strict=True))
    return tokens, logprobs, tops


def _groups(requests: Sequence[RolloutRequest]) -> dict[str, list[int]]:
    """Rows sampled together: same experiment (generator) and sampling settings."""
    groups: dict[str, list[int]] = defaultdict(list)
    for row, req in enumerate(requests):
        key = (req.group, req.temperature, req.top_p, req.top_logprobs, id(req.generator))
        groups["\0".join(map(str, key))].append(row)
    return dict(groups)


def distinct_prompts(requests: Sequence[RolloutRequest]) -> tuple[list[int], torch.Tensor]:
    """The first row of each distinct (slot, prompt), and for every row the position of
    its (slot, prompt) among those: GRPO asks for ``groupSize`` samples of each prompt."""
    first: dict[tuple[int, tuple[int, ...]], int] = {}
    firsts: list[int] = []
    inverse: list[int] = []
    for row, req in enumerate(requests):
        key = (req.slot, tuple(req.prompt_ids))
        if key not in first:
            first[key] = len(firsts)
            firsts.append(row)
        inverse.append(first[key])
    return firsts, torch.tensor(inverse, dtype=torch.long)


def _shared_prefill(
    route: RouteFn, forward: ForwardFn, requests: Sequence[RolloutRequest], pad_id: int
) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor]:
    """Prefill each distinct prompt once, then give every row its prompt's logits and KV
    cache (a gather): a group's samples differ only from their first sampled token on."""
    firsts, inverse = distinct_prompts(requests)
    ids, mask = left_pad([requests[i].prompt_ids for i in firsts], pad_id)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with route(torch.tensor([requests[i].slot for i in firsts], dtype=torch.long)):
        logits, past = forward(ids, mask, positions, None)
    if len(firsts) < len(requests):
        past.batch_select_indices(inverse)  # type: ignore[attr-defined]
        logits, mask, positions = logits[inverse], mask[inverse], positions[inverse]
    return logits, past, mask, positions


@torch.no_grad()
def generate(
    route: RouteFn,
    forward: ForwardFn,
    requests: Sequence[RolloutRequest],
    pad_id: int,
    eos_ids: Sequence[int] = (),
) -> list[Completion]:
    """Generate all requests in one batch; finished rows keep decoding pad (ignored).

    A row stops at any of ``eos_ids`` (kept in its completion); none: no row stops early,
    each generates exactly its ``max_new_tokens``.
    """
    if not requests:
        return []
    logits, past, mask, positions = _shared_prefill(route, forward, requests, pad_id)
    with route(torch.tensor([r.slot for r in requests], dtype=torch.long)):
        return _decode(forward, requests, logits, past, mask, positions, pad_id, eos_ids)


def _decode(
    forward: ForwardFn,
    requests: Sequence[RolloutRequest],
    logits: torch.Tensor,
    past: Any,
    mask: torch.Tensor,
    positions: torch.Tensor,
    pad_id: int,
    eos_ids: Sequence[int],
) -> list[Completion]:
    stops = torch.tensor(list(eos_ids), dtype=torch.long)
    limits = torch.tensor([r.max_new_tokens for r in requests])
    done = torch.zeros(len(requests), dtype=torch.bool)
    hit_eos = torch.zeros(len(requests), dtype=torch.bool)
    out = [_RowOutput(r) for r in requests]
    groups = _groups(requests)
    broken = torch.zeros(len(requests), dtype=torch.bool)
    next_pos = positions[:, -1]
    for step in range(int(limits.max())):
        tokens, logprobs, tops = _sample_rows(logits.float(), requests, groups, broken)
        for row in torch.nonzero(~done).flatten().tolist():
            out[row].add(int(tokens[row]), float(logprobs[row]), tops.get(row))
        if len(stops):
            hit_eos |= ~done & torch.isin(tokens, stops)
        done |= broken
        done |= hit_eos | (limits <= step + 1) | _cancelled(out, done)
        if bool(done.all()):
            break
        tokens = torch.where(done, torch.full_like(tokens, pad_id), tokens)
        next_pos = next_pos + 1
        mask = torch.cat([mask, torch.ones((len(requests), 1), dtype=mask.dtype)], dim=1)
        logits, past = forward(tokens[:, None], mask, next_pos[:, None], past)
    return [
        o.completion(bool(b), bool(e))
        for o, b, e in zip(out, broken.tolist(), hit_eos.tolist(), strict=True)
    ]


def _cancelled(out: list[_RowOutput], done: torch.Tensor) -> torch.Tensor:
    """Rows whose client left: they stop here, freeing the batch of their steps."""
    return torch.tensor(
        [not d and o.is_cancelled() for o, d in zip(out, done.tolist(), strict=True)]
    )


class _RowOutput:
    """One row's sampled tokens, reported to its sink (if any) as they come."""

    def __init__(self, request: RolloutRequest) -> None:
        self.sink = request.sink
        self.wants_top = request.top_logprobs > 0
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[dict[int, float]] = []
        self.cancelled = False

    def add(self, token: int, logprob: float, top: dict[int, float] | None) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        if self.wants_top:
            self.top.append(top or {})
        if self.sink is not None:
            self.sink.push(token, logprob, top)

    def is_cancelled(self) -> bool:
        self.cancelled = self.cancelled or (self.sink is not None and self.sink.cancelled())
        return self.cancelled

    def completion(self, broken: bool, hit_eos: bool) -> Completion:
        reason = "cancelled" if self.cancelled else "stop" if hit_eos else "length"
        return Completion(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            nonfinite=broken,
            top_logprobs=self.top if self.wants_top else None,
            finish_reason=reason,
        )
