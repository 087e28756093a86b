"""A datum's provenance checked against the engine's recordings
(server/tinker/provenance.py): each lie a 422 naming its span, and the recorded inputs a
truthful datum resolves to (the sampled targets marked, their recorded log-probs)."""

from __future__ import annotations

import numpy as np
import pytest
from loraplex_engine.server.tinker.provenance import DatumSpans, Span, resolve
from loraplex_engine.server.tinker.recorded import Recorder
from loraplex_engine.spec.errors import InvalidRequestError
from loraplex_engine.spec.training_service import ClientDatum, SampledRow

PROMPT = [5, 6, 7]
SAMPLED = [20, 21, 22]
LOGPROBS = [-0.25, -1.5, -0.75]


def recorder() -> Recorder:
    rec = Recorder()
    rec.record("a", "s1", "r", ["r:0"], PROMPT, [SampledRow(SAMPLED, LOGPROBS, "length")], "v")
    return rec


def datum(inputs: list[int] | None = None, targets: list[int] | None = None) -> ClientDatum:
    """rl_loop's shape: prompt + sampled[:-1] in, zeros then the sampled tokens out."""
    ids = inputs or PROMPT + SAMPLED[:-1]
    tgt = targets or [0] * (len(PROMPT) - 1) + SAMPLED
    return ClientDatum(ids, {"target_tokens": np.array(tgt, np.int64)})


def spans(sid: str = "r:0", offset: int = 0) -> DatumSpans:
    return DatumSpans(
        [Span(False, sid, 0, len(PROMPT)), Span(True, sid, offset, len(SAMPLED) - 1)],
        [Span(False, sid, 1, len(PROMPT) - 1), Span(True, sid, 0, len(SAMPLED))],
    )


def run(d: ClientDatum, s: DatumSpans, session: str = "s1") -> ClientDatum:
    rec = recorder()
    return resolve(d, s, lambda sid: rec.find("a", session, sid), "data[2]")


def test_a_truthful_datum_resolves_to_the_recorded_logprobs() -> None:
    got = run(datum(), spans()).recorded
    assert got is not None
    assert got.sampled.tolist() == [False, False, True, True, True]
    assert got.logprobs.tolist() == [0.0, 0.0, *LOGPROBS]


@pytest.mark.parametrize(
    "d,s,session,field",
    [
        (datum(), spans("r:9"), "s1", "data[2].model_input_spans[0].sequence_id"),
        (datum(), spans(), "s2", "data[2].model_input_spans[0].sequence_id"),
        (datum(), spans(offset=2), "s1", "data[2].model_input_spans[1].offset"),
        (datum(inputs=[5, 6, 7, 20, 99]), spans(), "s1", "data[2].model_input_spans[1]"),
        (datum(inputs=[5, 0, 7, 20, 21]), spans(), "s1", "data[2].model_input_spans[0]"),
        (datum(targets=[0, 0, 20, 21, 9]), spans(), "s1", "data[2].loss_fn_input_spans[1]"),
    ],
    ids=["unknown-id", "other-session", "past-the-end", "sampled-input", "prompt-input",
         "sampled-target"],
)  # fmt: skip
def test_each_lie_is_refused_naming_its_span(d, s, session, field) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        run(d, s, session)
    assert refused.value.field == field, refused.value
