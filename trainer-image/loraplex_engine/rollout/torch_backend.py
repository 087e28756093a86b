"""Rollouts through the engine's own multi-LoRA model: one KV-cached batch for all rows.

Sampling is our own loop rather than ``model.generate`` because each row carries its
own adapter, temperature, token limit and random generator; ``generate`` takes one of
each per call.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import torch

from loraplex_engine.rollout.base import Completion, RolloutRequest

# (input_ids, attention_mask, position_ids, past_key_values) -> (last logits, past)
ForwardFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, object], tuple[torch.Tensor, object]
]


def left_pad(prompts: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad so every row's next token sits in the last column."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def _sample_rows(
    logits: torch.Tensor,
    requests: Sequence[RolloutRequest],
    groups: dict[str, list[int]],
    broken: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; each group draws from its own generator, in row order.

    A group whose logits are not finite (a diverged adapter) gets pad tokens and is
    flagged in ``broken`` instead of failing the whole batch.
    """
    tokens = torch.empty(len(requests), dtype=torch.long)
    logprobs = torch.empty(len(requests), dtype=logits.dtype)
    for rows in groups.values():
        index = torch.tensor(rows)
        temperature = requests[rows[0]].temperature
        if not bool(torch.isfinite(logits[index]).all()):
            broken[index] = True
            tokens[index] = 0
            logprobs[index] = float("nan")
            continue
        if temperature <= 0:
            scaled = logits[index].log_softmax(-1)
            chosen = scaled.argmax(-1)
        else:
            scaled = (logits[index] / temperature).log_softmax(-1)
            chosen = torch.multinomial(
                scaled.exp(), 1, generator=requests[rows[0]].generator
            ).squeeze(-1)
        tokens[index] = chosen
        logprobs[index] = scaled.gather(-1, chosen[:, None]).squeeze(-1)
    return tokens, logprobs


def _groups(requests: Sequence[RolloutRequest]) -> dict[str, list[int]]:
    """Rows sampled together: same experiment (generator) and same temperature."""
    groups: dict[str, list[int]] = defaultdict(list)
    for row, req in enumerate(requests):
        groups[f"{req.group}\0{req.temperature}\0{id(req.generator)}"].append(row)
    return dict(groups)


@torch.no_grad()
def generate(
    forward: ForwardFn, requests: Sequence[RolloutRequest], pad_id: int, eos_id: int | None
) -> list[Completion]:
    """Generate all requests in one batch; finished rows keep decoding pad (ignored).

    ``eos_id`` None: no row stops early; each generates exactly its ``max_new_tokens``.
    """
    if not requests:
        return []
    ids, mask = left_pad([r.prompt_ids for r in requests], pad_id)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits, past = forward(ids, mask, positions, None)
    limits = torch.tensor([r.max_new_tokens for r in requests])
    done = torch.zeros(len(requests), dtype=torch.bool)
    hit_eos = torch.zeros(len(requests), dtype=torch.bool)
    out_tokens: list[list[int]] = [[] for _ in requests]
    out_logprobs: list[list[float]] = [[] for _ in requests]
    groups = _groups(requests)
    broken = torch.zeros(len(requests), dtype=torch.bool)
    next_pos = positions[:, -1]
    for step in range(int(limits.max())):
        tokens, logprobs = _sample_rows(logits.float(), requests, groups, broken)
        for row in torch.nonzero(~done).flatten().tolist():
            out_tokens[row].append(int(tokens[row]))
            out_logprobs[row].append(float(logprobs[row]))
        if eos_id is not None:
            hit_eos |= ~done & (tokens == eos_id)
        done |= broken
        done |= hit_eos | (limits <= step + 1)
        if bool(done.all()):
            break
        tokens = torch.where(done, torch.full_like(tokens, pad_id), tokens)
        next_pos = next_pos + 1
        mask = torch.cat([mask, torch.ones((len(requests), 1), dtype=mask.dtype)], dim=1)
        logits, past = forward(tokens[:, None], mask, next_pos[:, None], past)
    return [
        Completion(token_ids=t, logprobs=lp, finished=bool(e), nonfinite=bool(b))
        for t, lp, e, b in zip(
            out_tokens, out_logprobs, hit_eos.tolist(), broken.tolist(), strict=True
        )
    ]
