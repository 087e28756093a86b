"""Rollouts through the engine's own multi-LoRA model, one micro-batch at a time.

The rows are packed into micro-batches whose KV cache fits a token budget
(rollout/torch/packing.py), decoded one after another: the cache holds one micro-batch,
whatever the number of tenants. Sampling is our own loop rather than ``model.generate``
because each row carries its own adapter, temperature, token limit and random generator;
``generate`` takes one of each per call. Each step samples every row at once on the
model's device (rollout/torch/sampling.py); tokens and log-probs stay there until the
micro-batch ends, and only rows with a sink (served completions) are copied to the host
as they come.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from loraplex_engine.rollout.base import Completion, RolloutRequest
from loraplex_engine.rollout.torch.packing import DEFAULT_ROLLOUT_KV_TOKENS, pack_rollout
from loraplex_engine.rollout.torch.sampling import Draw, Sampler, contiguous_groups

if TYPE_CHECKING:
    from loraplex_engine.parallel.lockstep import Lockstep

# (input_ids, attention_mask, position_ids, past_key_values) -> (last logits, past); the
# logits ([rows, vocab], the last position only) stay on the model's device
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
    kv_token_budget: int = DEFAULT_ROLLOUT_KV_TOKENS,
    lockstep: Lockstep | None = None,
) -> list[Completion]:
    """Generate every request, in micro-batches of at most ``kv_token_budget`` KV tokens
    (rollout/torch/packing.py) decoded one after another; completions come back in request order.

    A row stops at any of ``eos_ids`` (kept in its completion); none: no row stops early,
    each generates exactly its ``max_new_tokens``. Finished rows of a micro-batch keep
    decoding pad (ignored) until all of it is done.

    ``lockstep`` (a sharded base: every forward is a collective, parallel/sharding.py): each
    forward is a lockstep round, and once this rank's rows are done it runs dummy
    one-token forwards for as long as another rank still decodes.
    """
    stepped = forward if lockstep is None else _in_step(forward, lockstep)
    out: list[Completion | None] = [None] * len(requests)
    for packed in pack_rollout(requests, kv_token_budget):
        rows = contiguous_groups(requests, packed)
        batch = [requests[i] for i in rows]
        for row, done in zip(
            rows, _micro_batch(route, stepped, batch, pad_id, eos_ids), strict=True
        ):
            out[row] = done
    if lockstep is not None:
        lockstep.drain(lambda: _dummy_forward(route, forward, pad_id))
    return [c for c in out if c is not None]


def _in_step(forward: ForwardFn, lockstep: Lockstep) -> ForwardFn:
    """``forward`` preceded by a lockstep round in which this rank says it works."""

    def stepped(ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, past: object):
        lockstep.step()
        return forward(ids, mask, pos, past)

    return stepped


def _dummy_forward(route: RouteFn, forward: ForwardFn, pad_id: int) -> None:
    """One pad token through the base (slot 0), no cache: the collectives of a forward."""
    one = torch.ones((1, 1), dtype=torch.long)
    with route(torch.zeros(1, dtype=torch.long)):
        forward(one * pad_id, one, one * 0, None)


def _micro_batch(
    route: RouteFn,
    forward: ForwardFn,
    requests: Sequence[RolloutRequest],
    pad_id: int,
    eos_ids: Sequence[int],
) -> list[Completion]:
    """One micro-batch: a shared prefill, then decoding until every row is done. Its KV
    cache lives only in this call."""
    logits, past, mask, positions = _shared_prefill(route, forward, requests, pad_id)
    mask, positions = mask.to(logits.device), positions.to(logits.device)
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
    """Decode on the logits' device; the only per-step host read is whether every row is
    done (and the rows with sinks)."""
    device, rows = logits.device, len(requests)
    sampler = Sampler(requests, device)
    stops = torch.tensor(list(eos_ids), dtype=torch.long, device=device)
    limits = torch.tensor([r.max_new_tokens for r in requests], device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    hit_eos, broken = torch.zeros_like(done), torch.zeros_like(done)
    streams = _Streams(requests, device)
    steps: list[tuple[Draw, torch.Tensor]] = []  # each step's draw and its live rows
    next_pos = positions[:, -1]
    for step in range(max(r.max_new_tokens for r in requests)):
        draw = sampler.step(logits)
        live = ~done
        steps.append((draw, live))
        streams.push(draw, live)
        broken |= draw.broken & live
        if len(stops):
            hit_eos |= live & torch.isin(draw.tokens, stops)
        done |= broken | hit_eos | (limits <= step + 1) | streams.cancelled(live)
        if bool(done.all()):  # the step's one sync
            break
        tokens = draw.tokens.masked_fill(done, pad_id)
        next_pos = next_pos + 1
        mask = torch.cat([mask, mask.new_ones((rows, 1))], dim=1)
        logits, past = forward(tokens[:, None], mask, next_pos[:, None], past)
    return _completions(requests, steps, broken, hit_eos, streams.was_cancelled)


def _completions(
    requests: Sequence[RolloutRequest],
    steps: list[tuple[Draw, torch.Tensor]],
    broken: torch.Tensor,
    hit_eos: torch.Tensor,
    cancelled: list[bool],
) -> list[Completion]:
    """Every row's tokens, copied to the host once: a row's tokens are the steps it was
    live for (a prefix: a finished row stays finished)."""
    if not steps:  # every row asked for no tokens
        return [Completion([], []) for _ in requests]
    draws = [d for d, _ in steps]
    tokens = torch.stack([d.tokens for d in draws], 1).cpu().tolist()
    logprobs = torch.stack([d.logprobs for d in draws], 1).cpu().tolist()
    lengths = torch.stack([live for _, live in steps], 1).sum(1).cpu().tolist()
    tops = _top_lists(requests, draws, lengths)
    flags = zip(broken.cpu().tolist(), hit_eos.cpu().tolist(), cancelled, strict=True)
    out = []
    for row, (is_broken, is_eos, is_cancelled) in enumerate(flags):
        n = lengths[row]
        reason = "cancelled" if is_cancelled else "stop" if is_eos else "length"
        out.append(
            Completion(
                token_ids=tokens[row][:n],
                logprobs=logprobs[row][:n],
                nonfinite=bool(is_broken),
                top_logprobs=tops[row],
                finish_reason=reason,
            )
        )
    return out


def _top_lists(
    requests: Sequence[RolloutRequest], draws: list[Draw], lengths: list[int]
) -> list[list[dict[int, float]] | None]:
    """Per row that asked for alternatives, per token, its top tokens' log-probs."""
    out: list[list[dict[int, float]] | None] = [None] * len(requests)
    if not any(r.top_logprobs for r in requests):
        return out
    ids = torch.stack([d.top_ids for d in draws], 1).cpu()  # type: ignore[misc]
    values = torch.stack([d.top_values for d in draws], 1).cpu()  # type: ignore[misc]
    for row, req in enumerate(requests):
        k = req.top_logprobs
        if k:
            row_ids = ids[row, : lengths[row], :k].tolist()
            row_values = values[row, : lengths[row], :k].tolist()
            out[row] = [
                dict(zip(i, v, strict=True)) for i, v in zip(row_ids, row_values, strict=True)
            ]
    return out


class _Streams:
    """The rows with a sink (served completions): each step's token goes to the host
    for them alone, and their clients may cancel them."""

    def __init__(self, requests: Sequence[RolloutRequest], device: torch.device) -> None:
        self.rows = [i for i, r in enumerate(requests) if r.sink is not None]
        self.sinks = [requests[i].sink for i in self.rows]
        self.wants_top = [requests[i].top_logprobs for i in self.rows]
        self.index = torch.tensor(self.rows, dtype=torch.long, device=device)
        self.was_cancelled = [False] * len(requests)
        self.device = device
        self._live: list[bool] = []

    def push(self, draw: Draw, live: torch.Tensor) -> None:
        if not self.rows:
            return
        tokens = draw.tokens[self.index].tolist()
        logprobs = draw.logprobs[self.index].tolist()
        self._live = live[self.index].tolist()
        top_ids = top_values = None
        if draw.top_ids is not None and draw.top_values is not None and any(self.wants_top):
            top_ids = draw.top_ids[self.index].tolist()
            top_values = draw.top_values[self.index].tolist()
        for i, sink in enumerate(self.sinks):
            if not self._live[i]:
                continue
            top = None
            k = self.wants_top[i]
            if k and top_ids is not None and top_values is not None:
                top = dict(zip(top_ids[i][:k], top_values[i][:k], strict=True))
            sink.push(tokens[i], logprobs[i], top)  # type: ignore[union-attr]

    def cancelled(self, live: torch.Tensor) -> torch.Tensor | bool:
        """Rows whose client left while they were live: they stop here."""
        if not self.rows:
            return False
        newly = []
        for i, sink in enumerate(self.sinks):
            row = self.rows[i]
            if self._live[i] and not self.was_cancelled[row] and sink.cancelled():  # type: ignore[union-attr]
                self.was_cancelled[row] = True
                newly.append(row)
        out = torch.zeros(live.shape, dtype=torch.bool)
        out[newly] = True
        return out.to(self.device)
