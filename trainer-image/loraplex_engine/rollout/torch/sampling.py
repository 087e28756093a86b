"""One token per row of a micro-batch, drawn on the logits' device, all rows at once.

Each row has its own temperature and ``top_p``; rows of one *sampling group* (same
experiment, settings and generator: ``sampling_key``) share their randomness. The draw
is the exponential race: with ``E_i ~ Exp(1)`` drawn independently per token,
``argmax_i p_i / E_i`` is distributed as ``p`` (a multinomial draw without the host),
so every row samples in one batched ``argmax`` and only the noise is made per group.

Where the noise comes from, and why: each group's request generator (a CPU
``torch.Generator``, one per experiment, saved in its checkpoints) draws one 63-bit seed
per micro-batch, which seeds a generator on the logits' device; that generator makes the
group's ``[rows, vocab]`` noise each step, in row order. A CPU generator cannot drive a
CUDA kernel, and drawing the noise on the host would copy ``rows x vocab`` floats to the
device every step; one seed per micro-batch costs one host draw. So an experiment's
samples depend on its generator, its rows and the micro-batch it is in (never split
while it fits the budget, rollout/torch/packing.py), not on who else is batched, and its generator
advances by one draw per micro-batch whatever the batch's length. The same seed gives
the same tokens on one device type; CPU and CUDA streams differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex_engine.rollout.base import RolloutRequest

SEED_BOUND = (1 << 63) - 1  # torch.randint's high bound is exclusive and an int64


def sampling_key(req: RolloutRequest) -> tuple[object, ...]:
    """Rows sampled together: same experiment, generator and sampling settings."""
    return (req.group, req.temperature, req.top_p, req.top_k, req.top_logprobs, id(req.generator))


def nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero every token outside each row's smallest set whose mass reaches its ``top_p``
    (the most likely token always stays; a ``top_p`` of inf keeps every token)."""
    sorted_probs, order = probs.sort(-1, descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p[:, None]
    return probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))


def top_k_only(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Zero every token below each row's ``keep``-th largest probability (0: keep all)."""
    k = keep.clamp(max=probs.shape[-1])
    values = probs.topk(int(k.max()), dim=-1).values
    kth = values.gather(-1, (k - 1).clamp(min=0)[:, None])
    return probs.masked_fill((probs < kth) & (k[:, None] > 0), 0.0)


@dataclass
class Draw:
    """One step's picks, all on the logits' device."""

    tokens: torch.Tensor  # [rows] long
    logprobs: torch.Tensor  # [rows] float32, under the temperature-scaled distribution
    broken: torch.Tensor  # [rows] bool: the row's group had non-finite logits
    top_ids: torch.Tensor | None  # [rows, k] the k most likely tokens (k: the rows' largest)
    top_values: torch.Tensor | None  # [rows, k] their log-probs


class Sampler:
    """Sampling state of one micro-batch; the rows of each sampling group must be
    contiguous (``contiguous_groups`` orders them so)."""

    def __init__(self, requests: Sequence[RolloutRequest], device: torch.device) -> None:
        keys: dict[tuple[object, ...], int] = {}
        group_of = [keys.setdefault(sampling_key(r), len(keys)) for r in requests]
        if any(later < earlier for later, earlier in zip(group_of[1:], group_of, strict=False)):
            raise ValueError("the rows of a sampling group must be contiguous")
        self.groups = len(keys)
        self.group_of = torch.tensor(group_of, dtype=torch.long, device=device)
        greedy = [r.temperature <= 0 for r in requests]
        self.greedy = torch.tensor(greedy, device=device)
        temps = [1.0 if g else r.temperature for g, r in zip(greedy, requests, strict=True)]
        self.temperature = torch.tensor(temps, dtype=torch.float32, device=device)
        cut = [r.top_p if r.top_p < 1.0 else float("inf") for r in requests]
        self.top_p = torch.tensor(cut, dtype=torch.float32, device=device)
        self.use_top_p = any(c != float("inf") for c, g in zip(cut, greedy, strict=True) if not g)
        self.top_k = max(r.top_logprobs for r in requests)
        keep = [
            r.top_k if r.top_k > 0 and not g else 0 for g, r in zip(greedy, requests, strict=True)
        ]
        self.keep_k = max(keep)  # 0: no row cuts to its top k
        self.keep = torch.tensor(keep, dtype=torch.long, device=device)
        # (first row, end row, device generator or None) of each sampled group
        self.draws: list[tuple[int, int, torch.Generator | None]] = []
        for start, end in _spans(group_of):
            req = requests[start]
            if req.temperature > 0:
                self.draws.append((start, end, _device_generator(req.generator, device)))

    @torch.no_grad()
    def step(self, logits: torch.Tensor) -> Draw:
        logits = logits.float()  # the last position only: [rows, vocab]
        row_bad = ~torch.isfinite(logits).all(-1)
        bad = torch.zeros(self.groups, dtype=torch.int32, device=logits.device)
        broken = bad.index_add_(0, self.group_of, row_bad.int())[self.group_of] > 0
        scaled = (logits / self.temperature[:, None]).log_softmax(-1)
        chosen = scaled.argmax(-1)
        if self.draws:
            probs = scaled.exp()
            if self.use_top_p:
                probs = nucleus(probs, self.top_p)
            if self.keep_k:
                probs = top_k_only(probs, self.keep)
            noise = torch.ones_like(probs)  # greedy rows: their draw is not used
            for start, end, gen in self.draws:
                noise[start:end].exponential_(generator=gen)
            noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # a 0 draw would pick p = 0
            chosen = torch.where(self.greedy, chosen, (probs / noise).argmax(-1))
        chosen = chosen.masked_fill(broken, 0)
        picked = scaled.gather(-1, chosen[:, None]).squeeze(-1)
        draw = Draw(chosen, picked.masked_fill(broken, float("nan")), broken, None, None)
        if self.top_k > 0:
            draw.top_values, draw.top_ids = scaled.topk(self.top_k, dim=-1)
        return draw


def contiguous_groups(requests: Sequence[RolloutRequest], rows: Sequence[int]) -> list[int]:
    """``rows`` reordered so each sampling group's rows are adjacent (groups in order of
    first row, rows in their order: each group draws in row order)."""
    by_key: dict[tuple[object, ...], list[int]] = {}
    for row in rows:
        by_key.setdefault(sampling_key(requests[row]), []).append(row)
    return [row for group in by_key.values() for row in group]


def _spans(group_of: list[int]) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    for row, g in enumerate(group_of):
        if spans and group_of[spans[-1][0]] == g:
            spans[-1] = (spans[-1][0], row + 1)
        else:
            spans.append((row, row + 1))
    return spans


def _device_generator(
    source: torch.Generator | None, device: torch.device
) -> torch.Generator | None:
    """A generator on ``device`` seeded from ``source`` (None: the device's default)."""
    if source is None:
        return None
    seed = int(torch.randint(0, SEED_BOUND, (1,), generator=source, device=source.device))
    return torch.Generator(device=device).manual_seed(seed)
