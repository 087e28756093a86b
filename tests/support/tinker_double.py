"""A TEST DOUBLE of the engine's TrainingService (spec/training_service.py), in memory, with
deterministic numbers: it lets the Tinker protocol layer (loraplex_engine/server/tinker/) be
tested with the real tinker SDK before the engine implements the contract. The
engine-backed tests come with the engine side (issue 28).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from loraplex_engine.spec.errors import InvalidRequestError, NoCapacityError, NotFoundError
from loraplex_engine.spec.training_service import (
    AdamStep,
    ClientDatum,
    ClientLora,
    ClientModelInfo,
    Forward,
    ForwardOutput,
    Limits,
    LoadState,
    LossCall,
    ModelCall,
    OptimStep,
    SampleCall,
    SampledRow,
    SampleOutput,
    SavedState,
    SaveState,
)


@dataclass
class _Model:
    info: ClientModelInfo
    steps: int = 0
    pending_grads: int = 0
    calls: list[str] = field(default_factory=list)


class FakeTraining:
    """In-memory TrainingService double: ``slots`` adapters at most, rank <= ``max_rank``."""

    def __init__(self, model_name: str, tokenizer_id: str, slots: int = 4, max_rank: int = 8):
        self.model_name = model_name
        self.tokenizer_id = tokenizer_id
        self.slots = slots
        self.max_rank = max_rank
        self.lock = threading.Lock()
        self.models: dict[tuple[str, str], _Model] = {}
        self.saved: dict[tuple[str, str], tuple[SavedState, int, ClientLora]] = {}
        self.log: list[tuple[str, str, str]] = []  # (call, namespace, model id)

    @property
    def limits(self) -> Limits:
        return Limits(vocab=32_000, context=None, max_tokens=262_144)

    def _model(self, ns: str, model_id: str) -> _Model:
        m = self.models.get((ns, model_id))
        if m is None:
            raise NotFoundError(f"no model {model_id!r}", field="model_id")
        return m

    def _new(self, ns: str, model_id: str, lora: ClientLora) -> ClientModelInfo:
        if lora.rank > self.max_rank:
            raise InvalidRequestError(
                f"rank {lora.rank} is over the engine's max rank {self.max_rank}",
                field="lora_config.rank",
            )
        if len(self.models) >= self.slots:
            raise NoCapacityError(f"all {self.slots} adapter slots are taken")
        info = ClientModelInfo(model_id, ns, self.model_name, self.tokenizer_id, lora)
        self.models[(ns, model_id)] = _Model(info)
        return info

    def create_model(self, namespace: str, model_id: str, lora: ClientLora) -> ClientModelInfo:
        with self.lock:
            self.log.append(("create_model", namespace, model_id))
            return self._new(namespace, model_id, lora)

    def create_model_from_state(
        self, namespace: str, model_id: str, path: str, with_optimizer: bool
    ) -> ClientModelInfo:
        with self.lock:
            state = self.saved.get((namespace, path))
            if state is None:
                raise NotFoundError(f"no checkpoint {path!r}", field="path")
            info = self._new(namespace, model_id, state[2])
            self.models[(namespace, model_id)].steps = state[1]
            self.log.append(("create_model_from_state", namespace, model_id))
            return info

    def model_info(self, namespace: str, model_id: str) -> ClientModelInfo:
        with self.lock:
            return self._model(namespace, model_id).info

    def list_models(self, namespace: str) -> list[ClientModelInfo]:
        with self.lock:
            return [m.info for (ns, _), m in self.models.items() if ns == namespace]

    def _forward(self, ns: str, model_id: str, data: list[ClientDatum], loss: LossCall):
        m = self._model(ns, model_id)
        outputs = []
        total = 0.0
        for d in data:
            n = len(d.input_ids)
            logprobs = np.full(n, -1.0 - 0.1 * m.steps, dtype=np.float32)
            weights = d.loss_inputs.get("weights", np.ones(n, dtype=np.float32))
            loss_el = (-logprobs * weights).astype(np.float32)
            total += float(loss_el.sum())
            outputs.append({"logprobs": logprobs, "elementwise_loss": loss_el})
        return m, ForwardOutput(outputs, {"loss:sum": total})

    def submit(
        self, namespace: str, model_id: str, call: ModelCall, order: int | None = None
    ) -> Answered:
        """Runs the call at once, in the order calls come (the protocol submits a model's
        calls in the SDK's order); its error raises here."""
        return Answered(self._run(namespace, model_id, call))

    def _run(self, namespace: str, model_id: str, call: ModelCall) -> Any:
        if isinstance(call, Forward):
            if call.backward:
                return self.forward_backward(namespace, model_id, call.data, call.loss)
            return self.forward(namespace, model_id, call.data, call.loss)
        if isinstance(call, OptimStep):
            return self.optim_step(namespace, model_id, call.adam)
        if isinstance(call, SaveState):
            return self.save_state(namespace, model_id, call.name, call.kind)
        if isinstance(call, LoadState):
            return self.load_state(namespace, model_id, call.path, call.with_optimizer)
        return self.unload_model(namespace, model_id)

    def forward(self, namespace, model_id, data, loss) -> ForwardOutput:
        with self.lock:
            return self._forward(namespace, model_id, data, loss)[1]

    def forward_backward(self, namespace, model_id, data, loss) -> ForwardOutput:
        with self.lock:
            m, out = self._forward(namespace, model_id, data, loss)
            m.pending_grads += len(data)
        return out

    def optim_step(self, namespace: str, model_id: str, adam: AdamStep) -> dict[str, float]:
        with self.lock:
            m = self._model(namespace, model_id)
            m.steps += 1
            grads, m.pending_grads = m.pending_grads, 0
        return {"grad_norm": float(grads), "learning_rate": adam.learning_rate}

    def save_state(self, namespace, model_id, name, kind, ttl_s=None) -> SavedState:
        with self.lock:
            m = self._model(namespace, model_id)
            path = f"tinker://{model_id}/{kind}/{name}"
            state = SavedState(path, kind, model_id, name, time.time(), 1234)
            self.saved[(namespace, path)] = (state, m.steps, m.info.lora)
            self.log.append((f"save_state:{kind}:{name}", namespace, model_id))
            return state

    def load_state(self, namespace, model_id, path, with_optimizer) -> None:
        with self.lock:
            m = self._model(namespace, model_id)
            state = self.saved.get((namespace, path))
            if state is None:
                raise NotFoundError(f"no checkpoint {path!r}", field="path")
            m.steps = state[1]

    def adoptable(self, namespace: str, model_id: str) -> None:
        return None  # no client experiments here

    def list_saved(self, namespace: str, model_id: str | None = None) -> list[SavedState]:
        with self.lock:
            return [
                s
                for (ns, _), (s, _, _) in self.saved.items()
                if ns == namespace and (model_id is None or s.model_id == model_id)
            ]

    def find_saved(self, namespace: str, path: str) -> SavedState:
        with self.lock:
            if (namespace, path) not in self.saved:
                raise NotFoundError(f"no saved weights at {path!r}", field="model_path")
            return self.saved[(namespace, path)][0]

    def sample(self, namespace: str, sampler: str, call: SampleCall) -> SampleOutput:
        with self.lock:
            if sampler == self.model_name:
                steps = 0
            else:
                state = self.saved.get((namespace, sampler))
                if state is None or state[0].kind != "sampler_weights":
                    raise NotFoundError(f"no sampler weights {sampler!r}", field="model_path")
                steps = state[1]
        rows = [
            SampledRow(
                [(call.prompt_ids[-1] + 1 + i + j + steps) % 50 for j in range(call.max_tokens)],
                [-0.25] * call.max_tokens,
                "length",
            )
            for i in range(call.num_samples)
        ]
        n = len(call.prompt_ids)
        prompt = [None] + [-0.5] * (n - 1) if call.prompt_logprobs else None
        topk = None
        if call.topk_prompt_logprobs:
            topk = [None] + [
                [(t, -0.5 - k) for k, t in enumerate(range(call.topk_prompt_logprobs))]
                for _ in range(n - 1)
            ]
        return SampleOutput(rows, prompt, topk)

    def unload_model(self, namespace: str, model_id: str, save: bool = True) -> None:
        with self.lock:
            self._model(namespace, model_id)
            if save:  # as the engine's: its last weights saved as weights/loraplex-final first
                self.log.append(("save_state:weights:loraplex-final", namespace, model_id))
            del self.models[(namespace, model_id)]
            self.log.append(("unload_model", namespace, model_id))


@dataclass
class Answered:
    """A call the double ran at once (TrainingService.submit's Pending)."""

    result: Any

    def wait(self) -> Any:
        return self.result
