"""Sampling a client's published weights through the engine's completion path.

A ``sample`` call names a ``sampler_weights`` path (or the base model). It must sample
*exactly* that version, never a later one: when the live adapter still is the published
version (same model incarnation, no optimiser step or load since) its slot serves the
rows; otherwise the published PEFT directory is loaded into a spare slot for the tick
(``~sample:`` adapters, removed after the rollout), so a model that trained on since, or
was unloaded, still samples what it published. No free slot: ``NoCapacityError`` (the
protocol layer retries). The rows are ``CompletionJob``\\ s in the tick's rollout batch
(completion_jobs.py): the same decoder, batching and seeded sampling as served
completions. Stop token ids and strings end a row through its sink (the torch rollout
stops decoding it) and are cut again from the result (the token that completed a stop is
kept). Prompt log-probs are one no-grad forward of the prompt in the same slot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraplex_engine.clients.inputs import Limits
from loraplex_engine.clients.saved import StatePath
from loraplex_engine.completion_jobs import CompletionJob
from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.spec.errors import InvalidRequestError
from loraplex_engine.spec.service import PromptJob
from loraplex_engine.spec.training_service import SampleCall, SampledRow, SampleOutput

# A stop string completes within its own length plus this many tokens of the end.
_STOP_WINDOW = 8


@dataclass
class Stops:
    """Per row: the tokens so far, and whether a stop token or string ended it."""

    call: SampleCall
    decode: Callable[[list[int]], str]
    tokens: list[list[int]] = field(default_factory=list)
    hit: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = [[] for _ in range(self.call.num_samples)]
        self.hit = [False] * self.call.num_samples
        self.window = max((len(s) for s in self.call.stop_strings), default=0) + _STOP_WINDOW

    @property
    def active(self) -> bool:
        return bool(self.call.stop_token_ids or self.call.stop_strings)

    def push(self, row: int, token_id: int, _logprob: float, _top: object) -> None:
        tokens = self.tokens[row]
        tokens.append(token_id)
        if not self.hit[row] and self.stops_at(tokens):
            self.hit[row] = True

    def cancelled(self, row: int) -> bool:
        return self.hit[row]

    def stops_at(self, tokens: list[int]) -> bool:
        """The last token completes a stop (token id, or a string in the decoded tail)."""
        if tokens[-1] in self.call.stop_token_ids:
            return True
        tail = self.decode(tokens[-self.window :]) if self.call.stop_strings else ""
        return any(s in tail for s in self.call.stop_strings)

    def cut(self, tokens: list[int]) -> int | None:
        """Length up to and including the first stop, None when none is hit."""
        for k in range(len(tokens)):
            if self.stops_at(tokens[: k + 1]):
                return k + 1
        return None


@dataclass
class SampleTask:
    namespace: str
    state: StatePath | None  # None: the base model
    call: SampleCall
    adapter: str | None = None  # the adapter serving it this tick (None: base, slot 0)
    job: CompletionJob | None = None
    stops: Stops | None = None
    prompt_logprobs: list[float | None] | None = None
    topk: list[list[tuple[int, float]] | None] | None = None
    # A published version (versions/publisher.py): its adapter name and directory.
    version: tuple[str, Path] | None = None

    def completion_job(self, base_model: str, decode: Callable[[list[int]], str]) -> CompletionJob:
        c = self.call
        self.stops = Stops(c, decode)
        watched = self.stops.active
        job = PromptJob(
            model=self.adapter or base_model,
            prompt_ids=list(c.prompt_ids),
            max_tokens=c.max_tokens,
            temperature=c.temperature,
            n=c.num_samples,
            top_p=c.top_p,
            top_k=c.top_k,
            top_logprobs=c.topk_sample_logprobs,
            seed=c.seed,
            on_token=self.stops.push if watched else None,
            cancelled=self.stops.cancelled if watched else None,
        )
        self.job = CompletionJob.of(job, base_model)
        return self.job

    def output(self) -> SampleOutput:
        assert self.job is not None and self.stops is not None
        rows = []
        for c in self.job.answer():
            n = self.stops.cut(c.token_ids) if self.stops.active else None
            tops = _likeliest_first(c.top_logprobs) if self.call.topk_sample_logprobs else None
            if n is not None:
                cut = None if tops is None else tops[:n]
                rows.append(SampledRow(c.token_ids[:n], c.logprobs[:n], "stop", cut))
            else:
                reason = "stop" if c.finish_reason == "stop" else "length"
                rows.append(SampledRow(list(c.token_ids), list(c.logprobs), reason, tops))
        return SampleOutput(rows, self.prompt_logprobs, self.topk)


def _likeliest_first(
    tops: list[dict[int, float]] | None,
) -> list[list[tuple[int, float]]] | None:
    if tops is None:
        return None
    return [sorted(t.items(), key=lambda kv: -kv[1]) for t in tops]


@torch.no_grad()
def prompt_logprobs(
    model: MultiLoRAModel,
    device: torch.device,
    slot: int,
    ids: list[int],
    k: int,
    last_n: int | None = None,
) -> tuple[list[float | None], list[list[tuple[int, float]] | None] | None]:
    """log p(prompt[i] | prompt[:i]) per position (None at 0), and with ``k`` the top
    ``k`` tokens of each position's distribution; with ``last_n`` only the last ``last_n``
    positions (the others None)."""
    lps, tops = _all_prompt_logprobs(model, device, slot, ids, k)
    if last_n is None:
        return lps, tops
    cut = len(ids) - last_n
    lps = [None] * cut + lps[cut:]
    return lps, None if tops is None else [None] * cut + tops[cut:]


def _all_prompt_logprobs(
    model: MultiLoRAModel, device: torch.device, slot: int, ids: list[int], k: int
) -> tuple[list[float | None], list[list[tuple[int, float]] | None] | None]:
    x = torch.tensor([ids], device=device)
    logits = model(input_ids=x, slot_ids=torch.tensor([slot], device=device)).logits
    logp = logits[0, :-1].float().log_softmax(-1)
    picked = logp.gather(-1, x[0, 1:, None]).squeeze(-1).tolist()
    lps: list[float | None] = [None, *picked]
    if k <= 0:
        return lps, None
    values, top_ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    tops: list[list[tuple[int, float]] | None] = [None]
    for ids_row, values_row in zip(top_ids.tolist(), values.tolist(), strict=True):
        tops.append(list(zip(ids_row, values_row, strict=True)))
    return lps, tops


def check_sample_call(call: SampleCall, limits: Limits) -> None:
    """A sample call's values within the engine's bounds (422 naming the field): the
    engine's own check, whatever door the call came through."""
    if not call.prompt_ids:
        raise InvalidRequestError("an empty prompt", field="prompt")
    bad = next((t for t in call.prompt_ids if not 0 <= t < limits.vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary", field="prompt")
    for name, ok in (
        ("num_samples", call.num_samples >= 1),
        ("max_tokens", call.max_tokens >= 1),
        ("temperature", call.temperature >= 0),
        ("top_k", -1 <= call.top_k <= limits.vocab),  # the door checks it too (server/tinker/)
        ("top_p", 0 < call.top_p <= 1),
        ("topk_prompt_logprobs", call.topk_prompt_logprobs >= 0),
        ("topk_sample_logprobs", call.topk_sample_logprobs >= 0),
        (
            "prompt_logprobs_last_n",
            call.prompt_logprobs_last_n is None
            or 1 <= call.prompt_logprobs_last_n < len(call.prompt_ids),
        ),
    ):
        if not ok:
            raise InvalidRequestError(f"{name} is out of range", field=f"sampling_params.{name}")
