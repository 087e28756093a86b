"""A client's training call checked before it is queued: every datum's tokens and loss
inputs, the loss and its config. Each problem is an ``InvalidRequestError`` naming the
field the way the SDK names it (``data[2].loss_fn_inputs.weights``), so a bad call fails
on its own thread and never reaches a tick that other models share.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from loraplex_engine.spec.errors import InvalidRequestError
from loraplex_engine.spec.training_service import ClientDatum, Limits, LossCall
from loraplex_engine.train.algorithms.tinker_losses import (
    TOKEN_LOSSES,
    TokenLoss,
    TokenLossInputs,
    build_token_loss,
)

# Float loss inputs the losses read, and the TokenLossInputs field each fills.
FLOAT_INPUTS = {
    "weights": "weights",
    "advantages": "advantages",
    "logprobs": "sampling_logprobs",
    "clip_low_threshold": "clip_low",
    "clip_high_threshold": "clip_high",
    "sequence_ratio_mask": "sequence_mask",
}
MASK = "sequence_ratio_mask"
TARGETS = "target_tokens"
RECORDED = "stable_reinforce"  # the loss that reads the engine's recorded sampling


@dataclass(frozen=True)
class Datum:
    """One checked datum: ``input_ids`` and ``targets`` (N each) and its float inputs."""

    input_ids: list[int]
    targets: torch.Tensor  # int64 [N]
    floats: dict[str, torch.Tensor]  # TokenLossInputs field -> float32 [N]

    @property
    def length(self) -> int:
        return len(self.input_ids)

    def loss_inputs(self, logprobs: torch.Tensor) -> TokenLossInputs:
        return TokenLossInputs(
            logprobs, **{k: v.to(logprobs.device) for k, v in self.floats.items()}
        )


def check_loss(loss: LossCall) -> TokenLoss:
    try:
        return build_token_loss(loss.name, loss.config)
    except KeyError as e:
        what = str(e.args[0])
        known = "" if what != "loss_fn" else f"; known: {sorted(TOKEN_LOSSES)}"
        raise InvalidRequestError(f"unknown {what} {loss.name!r}{known}", field=what) from None
    except ValueError as e:
        key = str(e).split(":", 1)[0]
        raise InvalidRequestError(str(e), field=f"loss_fn_config.{key}") from None


def check_data(data: Sequence[ClientDatum], loss: TokenLoss, limits: Limits) -> list[Datum]:
    if not data:
        raise InvalidRequestError("no data: a call needs at least one datum", field="data")
    total = sum(len(d.input_ids) for d in data)
    if total > limits.max_tokens:
        raise InvalidRequestError(
            f"{total} tokens in one call, over the engine's {limits.max_tokens}; split it",
            field="data",
        )
    return [_check_datum(i, d, loss, limits) for i, d in enumerate(data)]


def _check_datum(i: int, datum: ClientDatum, loss: TokenLoss, limits: Limits) -> Datum:
    where = f"data[{i}]"
    ids = list(datum.input_ids)
    n = len(ids)
    if n == 0:
        raise InvalidRequestError("no input tokens", field=f"{where}.model_input")
    if limits.context is not None and n > limits.context:
        raise InvalidRequestError(
            f"{n} tokens, over the model's context window of {limits.context}",
            field=f"{where}.model_input",
        )
    _check_ids(ids, limits.vocab, f"{where}.model_input")
    inputs: Mapping[str, np.ndarray] = datum.loss_inputs
    for key in inputs:
        if key != TARGETS and key not in FLOAT_INPUTS:
            raise InvalidRequestError(
                f"unknown loss input {key!r}; known: {sorted([TARGETS, *FLOAT_INPUTS])}",
                field=f"{where}.loss_fn_inputs.{key}",
            )
    for key in (TARGETS, *loss.required):
        if key not in inputs:
            raise InvalidRequestError(
                f"loss {loss.name!r} needs {key!r}", field=f"{where}.loss_fn_inputs.{key}"
            )
    targets = _vector(inputs[TARGETS], n, f"{where}.loss_fn_inputs.{TARGETS}")
    integral = np.issubdtype(targets.dtype, np.integer) or np.all(np.mod(targets, 1) == 0)
    if not integral:
        raise InvalidRequestError(
            "target tokens must be integers", field=f"{where}.loss_fn_inputs.{TARGETS}"
        )
    _check_ids(targets.astype(np.int64).tolist(), limits.vocab, f"{where}.loss_fn_inputs.{TARGETS}")
    floats: dict[str, torch.Tensor] = {}
    for key, name in FLOAT_INPUTS.items():
        if key in inputs:
            field = f"{where}.loss_fn_inputs.{key}"
            values = _vector(inputs[key], n, field).astype(np.float32)
            if not np.all(np.isfinite(values)):
                raise InvalidRequestError("values must be finite", field=field)
            floats[name] = torch.from_numpy(values.copy())
    if MASK in loss.required and not bool((floats["sequence_mask"] != 0).any()):
        raise InvalidRequestError(
            f"marks no token: {loss.name}'s sequence ratio needs at least one",
            field=f"{where}.loss_fn_inputs.{MASK}",
        )
    if loss.name == RECORDED:
        floats.update(_recorded(datum, n, where))
    return Datum(ids, torch.from_numpy(targets.astype(np.int64)), floats)


def _recorded(datum: ClientDatum, n: int, where: str) -> dict[str, torch.Tensor]:
    """The engine's recorded sampler log-probs in place of the client's ``logprobs``,
    and the mask of the targets it sampled."""
    rec = datum.recorded
    if rec is None:
        raise InvalidRequestError(
            "stable_reinforce needs provenance: spans naming the sampled sequences "
            "(Datum.with_provenance) from a sampler with record_stability_info",
            field=f"{where}.loss_fn_input_spans",
        )
    if rec.sampled.shape != (n,) or rec.logprobs.shape != (n,):
        raise InvalidRequestError("provenance does not cover the targets", f"{where}")
    sampled = torch.from_numpy(rec.sampled.astype(np.float32))
    return {
        "sampling_logprobs": torch.from_numpy(rec.logprobs.astype(np.float32)),
        "sampled_mask": sampled,
    }


def _vector(value: object, n: int, field: str) -> np.ndarray:
    try:
        array = np.asarray(value)
    except (TypeError, ValueError):
        raise InvalidRequestError("not an array of numbers", field=field) from None
    if array.dtype.kind not in "iuf":
        raise InvalidRequestError(f"not an array of numbers (dtype {array.dtype})", field=field)
    if array.shape != (n,):
        raise InvalidRequestError(
            f"shape {list(array.shape)}, expected [{n}] (one per input token)", field=field
        )
    return array


def _check_ids(ids: Sequence[int], vocab: int, field: str) -> None:
    bad = next((t for t in ids if not 0 <= int(t) < vocab), None)
    if bad is not None:
        raise InvalidRequestError(
            f"token id {bad} is outside the model's vocabulary (0..{vocab - 1})", field=field
        )
