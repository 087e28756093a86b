"""A datum's provenance (the SDK's ``Datum.with_provenance``): runs of spans tiling its
input tokens (``model_input_spans``) and its targets (``loss_fn_input_spans``), each naming
a recorded sequence (server/tinker/recorded.py) and a position in its prompt or its
sampled tokens. Read from the wire here, then checked against the engine's recordings and
turned into the :class:`RecordedInputs` the ``stable_reinforce`` loss trains on.

The checks, each a 422 naming the span (``data[3].model_input_spans[1].sequence_id``):
the runs tile their field exactly; every sequence id is recorded in the training model's
session (not unknown, expired or pushed out); a run lies inside its sequence's prompt or
sampled tokens; input tokens equal the prompt or sampled tokens they claim; a target a
sampled run covers equals the token sampled there. A target a prompt run covers carries
no loss, so its value is not checked (the cookbook's rl_loop sends 0 there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from loraplex_engine.server.tinker.recorded import Found
from loraplex_engine.spec.errors import InvalidRequestError
from loraplex_engine.spec.training_service import ClientDatum, RecordedInputs

INPUT_SPANS = "model_input_spans"
TARGET_SPANS = "loss_fn_input_spans"
MAX_SPANS = 4096  # runs a field may have (a multi-turn episode has two a turn)


@dataclass(frozen=True)
class Span:
    sampled: bool  # a run of sampled tokens; else of the request's prompt
    sequence_id: str
    offset: int
    length: int


@dataclass(frozen=True)
class DatumSpans:
    model_input: list[Span]
    loss_fn_inputs: list[Span]


# (sequence id) -> the recording, or why there is none
Lookup = Callable[[str], Found | str]


def read_spans(datum: pb.Datum, n_tokens: int, where: str) -> DatumSpans | None:
    """The datum's spans, each field's runs tiling its ``n_tokens``; None when it has none."""
    if not datum.model_input_spans and not datum.loss_fn_input_spans:
        return None
    return DatumSpans(
        _read(datum.model_input_spans, n_tokens, f"{where}.{INPUT_SPANS}"),
        _read(datum.loss_fn_input_spans, n_tokens, f"{where}.{TARGET_SPANS}"),
    )


def _read(msgs: Sequence[pb.ProvenanceSpan], n_tokens: int, field: str) -> list[Span]:
    if len(msgs) > MAX_SPANS:
        raise InvalidRequestError(f"{len(msgs)} runs; at most {MAX_SPANS}", field=field)
    spans = []
    for j, msg in enumerate(msgs):
        kind = msg.WhichOneof("span")
        if kind is None:
            raise InvalidRequestError("neither prompt_tokens nor sampled_tokens", f"{field}[{j}]")
        arm = getattr(msg, kind)
        if not arm.sequence_id or len(arm.sequence_id) > 256:
            raise InvalidRequestError("1-256 characters", field=f"{field}[{j}].sequence_id")
        spans.append(Span(kind == "sampled_tokens", arm.sequence_id, arm.offset, arm.length))
    covered = sum(s.length for s in spans)
    if covered != n_tokens:
        raise InvalidRequestError(
            f"the runs cover {covered} positions; the field has {n_tokens} (they must tile it)",
            field=field,
        )
    return spans


def resolve(datum: ClientDatum, spans: DatumSpans, lookup: Lookup, where: str) -> ClientDatum:
    """``datum`` with its :class:`RecordedInputs`, every span checked against ``lookup``."""
    n = len(datum.input_ids)
    inputs = np.asarray(datum.input_ids, dtype=np.int64)
    pos = 0
    for j, span in enumerate(spans.model_input):
        field = f"{where}.{INPUT_SPANS}[{j}]"
        _, claimed = _claimed(span, lookup, field)
        if not np.array_equal(inputs[pos : pos + span.length], claimed):
            what = "sampled" if span.sampled else "prompt"
            raise InvalidRequestError(
                f"the input tokens at {pos}..{pos + span.length - 1} differ from the {what} "
                f"tokens {span.offset}..{span.offset + span.length - 1} of {span.sequence_id!r}",
                field=field,
            )
        pos += span.length
    targets = np.asarray(datum.loss_inputs.get("target_tokens", np.zeros(n)), dtype=np.int64)
    sampled = np.zeros(n, dtype=bool)
    logprobs = np.zeros(n, dtype=np.float32)
    pos = 0
    for j, span in enumerate(spans.loss_fn_inputs):
        field = f"{where}.{TARGET_SPANS}[{j}]"
        found, claimed = _claimed(span, lookup, field)
        end = pos + span.length
        if span.sampled:
            if targets.shape != (n,) or not np.array_equal(targets[pos:end], claimed):
                raise InvalidRequestError(
                    f"target_tokens at {pos}..{end - 1} differ from the sampled tokens "
                    f"{span.offset}..{span.offset + span.length - 1} of {span.sequence_id!r}",
                    field=field,
                )
            sampled[pos:end] = True
            logprobs[pos:end] = found.sequence.logprobs[span.offset : span.offset + span.length]
        pos = end
    return ClientDatum(datum.input_ids, datum.loss_inputs, RecordedInputs(sampled, logprobs))


def _claimed(span: Span, lookup: Lookup, field: str) -> tuple[Found, np.ndarray]:
    """The recorded tokens ``span`` claims: 422 when its sequence or range is not there."""
    found = lookup(span.sequence_id)
    if isinstance(found, str):
        raise InvalidRequestError(
            f"sequence {span.sequence_id!r}: {found} (sample with record_stability_info, "
            "in the training model's session)",
            field=f"{field}.sequence_id",
        )
    source = found.sequence.tokens if span.sampled else found.prompt
    if span.offset + span.length > source.size:
        what = "sampled tokens" if span.sampled else "prompt"
        raise InvalidRequestError(
            f"offset {span.offset} + length {span.length} is past the {source.size} "
            f"{what} of {span.sequence_id!r}",
            field=f"{field}.offset",
        )
    return found, source[span.offset : span.offset + span.length].astype(np.int64)
