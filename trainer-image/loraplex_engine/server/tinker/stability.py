"""The ``stable_reinforce`` loss's two doors in the Tinker protocol: a sample with
``record_stability_info`` is recorded (server/tinker/recorded.py), and a
``forward_backward`` with ``loss_fn="stable_reinforce"`` has each datum's provenance
checked against those recordings and resolved into the engine's own sampled tokens and
log-probs (server/tinker/provenance.py) before it is queued: a bad datum fails its own
request at the door, never a tick it would share with other tenants.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loraplex_engine.server.tinker.provenance import resolve
from loraplex_engine.server.tinker.recorded import Recorder
from loraplex_engine.server.tinker.state import Registry
from loraplex_engine.server.tinker.wire import ForwardBackwardCall
from loraplex_engine.spec.errors import InvalidRequestError
from loraplex_engine.spec.tinker_limits import RecordLimits
from loraplex_engine.spec.training_service import ClientDatum, SampleCall, SampleOutput

LOSS = "stable_reinforce"
FIELD = "record_stability_info"

# Records a finished sample: (its request id, its sequence ids, its output).
Record = Callable[[str, list[str], SampleOutput], None]


class Stability:
    def __init__(self, registry: Registry, limits: RecordLimits | None = None) -> None:
        self.registry = registry
        self.recorder = Recorder(limits)

    def before_sample(
        self, namespace: str, body: dict[str, Any], call: SampleCall, version: str
    ) -> Record | None:
        """For a sample that asks to be recorded: checked now, recorded once it is done."""
        if not body.get(FIELD):
            return None
        sampler_id = body.get("sampling_session_id")
        if not sampler_id:
            raise InvalidRequestError(
                "recordings belong to a session: sample through a sampling client "
                "(a sampling_session_id)",
                field=FIELD,
            )
        session_id = self.registry.sampler(namespace, sampler_id).session_id
        self.recorder.check_fits(len(call.prompt_ids), call.num_samples, call.max_tokens)
        prompt, recorder = list(call.prompt_ids), self.recorder

        def record(key: str, sequence_ids: list[str], out: SampleOutput) -> None:
            recorder.record(namespace, session_id, key, sequence_ids, prompt, out.rows, version)

        return record

    def data(self, namespace: str, session_id: str, call: ForwardBackwardCall) -> list[ClientDatum]:
        """The call's data; for stable_reinforce each datum with its recorded inputs (one
        without provenance is left for the engine's check to name)."""
        if call.loss.name != LOSS:
            return call.data  # provenance means nothing to another loss
        out = []
        for i, (datum, spans) in enumerate(zip(call.data, call.spans, strict=True)):
            if spans is None:
                out.append(datum)
                continue

            def lookup(sequence_id: str) -> Any:
                return self.recorder.find(namespace, session_id, sequence_id)

            out.append(resolve(datum, spans, lookup, f"data[{i}]"))
        return out

    def end_session(self, namespace: str, session_id: str) -> None:
        self.recorder.end_session(namespace, session_id)

    def sweep(self) -> None:
        self.recorder.sweep(self.registry.is_open)
