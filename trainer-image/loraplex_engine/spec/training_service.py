"""What the engine offers a client that drives its own training loop (the Tinker protocol,
server/tinker/): models created, stepped, saved and sampled by their client, on the same adapter
slots, fair share, tick and run store as the engine's own experiments.

This is the boundary between the protocol layer and the engine, as spec/service.py is for the
OpenAI routes: the protocol layer imports this module and the errors, never torch or the
engine's internals. Arrays cross as numpy (the SDK's ``TensorData`` is numpy already).

Identity: every call names the caller's namespace (from its API key); a model, a saved
path or a sampler of another namespace is :class:`~loraplex_engine.spec.errors.NotFoundError`,
never a different error, so a key learns nothing about other namespaces.

Errors are :mod:`loraplex_engine.spec.errors`' ``ApiError``\\ s naming the field
(``InvalidRequestError(field=...)``); a full engine raises ``NoCapacityError``, which the
protocol layer turns into the SDK's "paused for capacity" queue state and retries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

# The Tinker SDK's loss names (tinker.types.LossFnType) the engine implements.
LossName = Literal[
    "cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"
]
StopReason = Literal["length", "stop"]


@dataclass(frozen=True)
class ClientLora:
    """A client model's adapter: its own rank, and which module kinds carry LoRA."""

    rank: int
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


@dataclass(frozen=True)
class RecordedInputs:
    """What the engine itself recorded when it sampled a datum's tokens (a sample with
    ``record_stability_info``), aligned with the datum's N targets: ``sampled`` (bool [N])
    marks the targets its provenance names as sampled tokens, ``logprobs`` (float32 [N])
    the sampler's log-prob of each (0 elsewhere). The protocol layer resolves it from the
    datum's provenance spans (server/tinker/provenance.py); ``stable_reinforce`` reads it."""

    sampled: np.ndarray
    logprobs: np.ndarray


@dataclass(frozen=True)
class ClientDatum:
    """One sequence: ``input_ids`` (N tokens) and the loss's inputs, each a 1-D array of N:
    ``target_tokens`` (int64: the token position i predicts), ``weights``, ``advantages``,
    ``logprobs`` (the sampler's), ``clip_low_threshold``/``clip_high_threshold``,
    ``sequence_ratio_mask`` (gspo's; float32),
    as the SDK's ``Datum.loss_fn_inputs`` names them; ``recorded``: the engine's own record
    of its sampled tokens, where its provenance named one."""

    input_ids: list[int]
    loss_inputs: Mapping[str, np.ndarray]
    recorded: RecordedInputs | None = None


@dataclass(frozen=True)
class LossCall:
    """Which loss, with the SDK's ``loss_fn_config`` (e.g. ppo's clip thresholds)."""

    name: LossName
    config: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ForwardOutput:
    """Per datum, the SDK's ``loss_fn_outputs``: ``logprobs`` (float32 [N]: log p of each
    target token) and ``elementwise_loss`` (float32 [N]); ``metrics`` as the SDK reports
    them (``loss:sum``, ...)."""

    outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float]


@dataclass(frozen=True)
class AdamStep:
    """``tinker.types.AdamParams``: one optimiser step's settings (0 clip norm: none)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass(frozen=True)
class SampleCall:
    prompt_ids: list[int]
    num_samples: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1  # -1: off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    # Score only the prompt's last N positions (earlier ones None); None: all of them.
    prompt_logprobs_last_n: int | None = None
    topk_sample_logprobs: int = 0  # the k likeliest tokens at each sampled position


@dataclass(frozen=True)
class Limits:
    """What the engine's model takes: token ids below ``vocab``, rows of at most
    ``context`` tokens (None: unbounded) and at most ``max_tokens`` tokens a call."""

    vocab: int
    context: int | None
    max_tokens: int


@dataclass(frozen=True)
class SampledRow:
    token_ids: list[int]
    logprobs: list[float]
    stop_reason: StopReason
    # Per sampled token, the k likeliest (token, log-prob), likeliest first; None: not asked.
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(frozen=True)
class SampleOutput:
    rows: list[SampledRow]
    # Per prompt position (None at position 0); None when not asked for.
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None


@dataclass(frozen=True)
class ClientModelInfo:
    model_id: str
    namespace: str
    base_model: str
    tokenizer_id: str  # what the SDK's get_tokenizer loads (a name or a local path)
    lora: ClientLora


@dataclass(frozen=True)
class SavedState:
    """A saved checkpoint: ``path`` is the ``tinker://`` URI the SDK passes back."""

    path: str
    kind: Literal["weights", "sampler_weights", "external_weights"]
    model_id: str
    name: str
    created: float  # unix seconds
    size_bytes: int
    expires: float | None = None  # unix seconds; None: kept until deleted


@dataclass(frozen=True)
class Adoption:
    """A client experiment's model as the Tinker protocol takes it over: its rank, the
    optimiser steps its restored checkpoint holds, how often it checkpoints, and its
    journal's directory (server/tinker/journal.py)."""

    rank: int
    steps: int
    checkpoint_every: int
    journal_dir: str


@dataclass(frozen=True)
class Forward:
    """``forward`` (``backward`` False) or ``forward_backward``."""

    data: list[ClientDatum]
    loss: LossCall
    backward: bool = False


@dataclass(frozen=True)
class OptimStep:
    adam: AdamStep


@dataclass(frozen=True)
class SaveState:
    """``weights``: adapter and optimiser state (resumable); ``sampler_weights``: the
    adapter as published for sampling (that version, frozen; held in memory, bounded);
    ``external_weights``: the adapter as a PEFT directory to download. ``ttl_s``: removed
    that many seconds from now (None: kept until deleted)."""

    name: str
    kind: Literal["weights", "sampler_weights", "external_weights"]
    ttl_s: float | None = None


@dataclass(frozen=True)
class LoadState:
    path: str
    with_optimizer: bool


@dataclass(frozen=True)
class Unload:
    save: bool = True  # its last weights as ``weights/loraplex-final`` first


ModelCall = Forward | OptimStep | SaveState | LoadState | Unload


class Pending(Protocol):
    """A submitted call, queued: its answer once a tick has run it."""

    def wait(self) -> Any:
        """Blocks until answered; raises the call's error."""


class TrainingService(Protocol):
    """Thread-safe. Operations of one model run in their queue's order (``submit``); calls
    of different models pending together share a tick (one fused forward/backward)."""

    @property
    def model_name(self) -> str: ...

    @property
    def limits(self) -> Limits:
        """What a call may ask: token ids, row length, tokens a call (checked at the door)."""

    def create_model(self, namespace: str, model_id: str, lora: ClientLora) -> ClientModelInfo:
        """A fresh adapter in a free slot; ``NoCapacityError`` when none is free."""

    def create_model_from_state(
        self, namespace: str, model_id: str, path: str, with_optimizer: bool
    ) -> ClientModelInfo: ...

    def model_info(self, namespace: str, model_id: str) -> ClientModelInfo: ...

    def list_models(self, namespace: str) -> list[ClientModelInfo]: ...

    def submit(
        self, namespace: str, model_id: str, call: ModelCall, order: int | None = None
    ) -> Pending:
        """Check ``call`` and put it on the model's queue at once, the one queue that orders
        the model's calls: by ``order`` (the SDK's ``seq_id``; None after every numbered
        call) among those no tick has taken yet, then by arrival. A call refused raises
        here (nothing is queued); its answer (or error) comes from ``Pending.wait``.
        Forward/ForwardBackward: the loss and log-probs (gradients accumulate until an
        OptimStep); OptimStep: this model's adapter alone with the accumulated gradient,
        then cleared; SaveState ``weights``: adapter and optimiser state (resumable),
        ``sampler_weights``: the adapter as published for sampling; Unload frees its
        slot."""

    def list_saved(self, namespace: str, model_id: str | None = None) -> list[SavedState]: ...

    def find_saved(self, namespace: str, path: str) -> SavedState:
        """The caller's saved state at ``path``; NotFoundError saying why when none."""

    def delete_saved(self, namespace: str, path: str) -> None:
        """Removes the caller's saved state at ``path``; NotFoundError when it has none."""

    def set_saved_ttl(self, namespace: str, path: str, ttl_s: float | None) -> None:
        """The state at ``path`` expires ``ttl_s`` from now (None: never)."""

    def saved_files(self, namespace: str, path: str) -> dict[str, Path]:
        """An ``external_weights`` state's files, by name relative to its root."""

    def adoptable(self, namespace: str, model_id: str) -> Adoption | None:
        """A client experiment's model loaded here (a ``LoRAExperiment`` with
        ``spec.client``, placed by the operator), None if ``model_id`` is none here."""

    def sample(self, namespace: str, sampler: str, call: SampleCall) -> SampleOutput:
        """``sampler``: a ``sampler_weights`` path (exactly that version's weights) or the
        base model's name."""
