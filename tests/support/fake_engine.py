"""A fake EngineService: just enough of the engine for the HTTP layer's tests (error
mapping, validation, auth, metrics, the loop) to run in milliseconds, with states a real
engine reaches only rarely (a tick raising, an engine that never finishes loading)."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import Any

from loraplex_engine.spec.api_types import (
    Capacity,
    CheckpointRef,
    ExperimentStatus,
    ExperimentTick,
    MemoryUse,
    TickReport,
)
from loraplex_engine.spec.errors import (
    ConflictError,
    InvalidSpecError,
    NoCapacityError,
    NotFoundError,
)
from loraplex_engine.spec.service import PromptJob, ServedRow


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeEngine:
    """Just enough of EngineService to exercise the HTTP layer."""

    model_name = "fake-base"
    rollout_backend = "torch"
    context_tokens = None

    def __init__(self, max_adapters: int = 2, max_rank: int = 16) -> None:
        self.max_adapters = max_adapters
        self.max_rank = max_rank
        self.lock = threading.Lock()
        self.exps: dict[str, tuple[Any, ExperimentStatus]] = {}
        self.ready = True
        self.calls: list[str] = []
        self.capacity_calls = 0  # the whole capacity answer: psutil, CUDA, the memory plan
        self.fail_ticks = 0

    def _spec_dict(self, spec: Any) -> dict[str, Any]:
        if hasattr(spec, "model_dump"):
            return spec.model_dump(by_alias=True, exclude_none=True)
        return dict(spec)

    def is_ready(self) -> bool:
        return self.ready

    def put_experiment(self, exp_id, spec, namespace, name, resume_from, run_id=None):
        self.calls.append(f"put {exp_id}")
        spec = self._spec_dict(spec)
        rank = spec.get("lora", {}).get("rank", 8)
        if rank > self.max_rank:
            raise InvalidSpecError(
                f"rank {rank} exceeds the engine's max rank {self.max_rank}", "spec.lora.rank"
            )
        with self.lock:
            if exp_id in self.exps:
                old_spec, status = self.exps[exp_id]
                if old_spec != spec:
                    raise ConflictError(f"{exp_id} is loaded with a different spec", "spec")
                return status, False
            if len(self.exps) >= self.max_adapters:
                raise NoCapacityError("no free adapter slot")
            status = ExperimentStatus(
                id=exp_id, namespace=namespace, name=name, phase="Running", step=0,
                max_steps=10, reward=None, rollout_tokens=0, train_tokens=0, checkpoint=None,
                adapter_path=None, error=None, started_at=_now(), updated_at=_now(),
                run_id=run_id or "made-by-engine",
            )  # fmt: skip
            self.exps[exp_id] = (spec, status)
            return status, True

    def get_experiment(self, exp_id):
        with self.lock:
            if exp_id not in self.exps:
                raise NotFoundError(f"no experiment {exp_id}")
            return self.exps[exp_id][1]

    def list_experiments(self):
        with self.lock:
            return [s for _, s in self.exps.values()]

    def checkpoint_experiment(self, exp_id):
        status = self.get_experiment(exp_id)
        return CheckpointRef(
            path=f"/ckpt/{status.namespace}/{status.name}/step-1", step=status.step
        )

    def remove_experiment(self, exp_id):
        self.calls.append(f"delete {exp_id}")
        status = self.get_experiment(exp_id)
        with self.lock:
            del self.exps[exp_id]
        return status

    def capacity(self):
        self.capacity_calls += 1
        with self.lock:
            return Capacity(
                model=self.model_name, rollout_backend="torch", max_adapters=self.max_adapters,
                max_rank=self.max_rank, dtype="float32", gradient_checkpointing=False,
                used_slots=len(self.exps), experiments=sorted(self.exps),
                memory=MemoryUse(rss_bytes=1000, device_bytes=0),
            )  # fmt: skip

    # One character per token: the HTTP layer's usage and text come from these ids.
    def tokenize(self, prompt):
        return [ord(ch) for ch in prompt] if isinstance(prompt, str) else list(prompt)

    def detokenize(self, token_ids):
        return "".join(map(chr, token_ids))

    def chat_prompt(self, messages):
        return self.tokenize("".join(f"{m['role']}: {m['content']}\n" for m in messages))

    def complete(self, job: PromptJob) -> list[ServedRow]:
        self.calls.append(f"complete {job.model}")
        if job.model != self.model_name and job.model not in self.exps:
            raise NotFoundError(f"no model {job.model}", "model")
        texts = [f"{job.model}:{self.detokenize(job.prompt_ids)}:{i}" for i in range(job.n)]
        return [ServedRow(self.tokenize(t), [0.0] * len(t), finish_reason="stop") for t in texts]

    def tick(self):
        if self.fail_ticks:
            self.fail_ticks -= 1
            raise RuntimeError("boom")
        with self.lock:
            running = [s for _, s in self.exps.values() if s.phase == "Running"]
            for s in running:
                s.step += 1
                s.reward = 0.5
        if not running:
            return None
        ticks = [ExperimentTick(s.id, s.namespace, s.step, 0.5, 10, 20) for s in running]
        return TickReport(0.01, {"rollout": 0.005, "train": 0.005}, ticks)
