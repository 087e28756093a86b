"""The hot engine: one frozen base model, one adapter slot per experiment, and a tick
that advances every running experiment by one RL step at once.

Tick = mixed-adapter rollout → rewards → one fused forward/backward → per-adapter
optimiser step → rollout-backend sync → bookkeeping and checkpoints. Experiments join
and leave between ticks (``_model_lock``); an experiment whose reward raises or whose
update goes non-finite fails alone. Reads (status, capacity) never wait for a tick.
"""

from __future__ import annotations

import logging
import math
import os
import random
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from loraplex_engine import checkpoint as ckpt
from loraplex_engine.algorithms import Algorithm, get_algorithm
from loraplex_engine.api_types import (
    DEFAULT_MAX_STEP_TOKENS,
    Capacity,
    CheckpointRef,
    ExperimentStatus,
    ExperimentTick,
    TickReport,
)
from loraplex_engine.errors import (
    AdapterError,
    BadCheckpointError,
    CheckpointError,
    ConflictError,
    InvalidRequestError,
    InvalidSpecError,
    NoCapacityError,
    NoFreeSlotError,
    NotFoundError,
    RankTooLargeError,
    RewardError,
    TaskError,
    UnknownTargetModuleError,
)
from loraplex_engine.lora import LoRAConfig
from loraplex_engine.multi_lora import MultiLoRAModel
from loraplex_engine.optim import AdamWSettings, PerAdapterAdamW
from loraplex_engine.rollout.backends import RolloutBackend, TorchRollout, VLLMRolloutBackend
from loraplex_engine.rollout.base import Completion, RolloutRequest
from loraplex_engine.spec import ExperimentSpec
from loraplex_engine.tasks import Prompt, Task, build_task
from loraplex_engine.training import (
    ExperimentUpdate,
    SharedForward,
    TrainRow,
    fused_backward,
    prefix_sharing_unsupported,
    shared_prefix_forward,
)

PHASES = ("rollout", "reward", "train", "sync", "checkpoint")

log = logging.getLogger("loraplex_engine.engine")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


@dataclass
class Experiment:
    """Everything the engine keeps for one loaded experiment."""

    id: str
    namespace: str
    name: str
    spec: ExperimentSpec
    task: Task
    algorithm: Algorithm
    prompt_rng: random.Random  # which prompts; seeded from spec.algorithm.seed
    sample_gen: torch.Generator  # which tokens; seeded likewise
    phase: str = "Running"
    step: int = 0
    reward: float | None = None
    rollout_tokens: int = 0
    train_tokens: int = 0
    checkpoint: CheckpointRef | None = None
    adapter_path: str | None = None
    error: str | None = None
    started_at: str = field(default_factory=_now)
    updated_at: str = field(default_factory=_now)
    # Ties this run's checkpoints together across engines and names their directory
    # (<root>/<ns>/<name>/<run id>/): given by the caller (the operator: the object's uid),
    # or made at a fresh start and carried over on resume, so a recreated experiment of the
    # same name writes elsewhere and never prunes or overwrites the old run's checkpoints.
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def max_steps(self) -> int:
        return self.spec.algorithm.max_steps

    def status(self) -> ExperimentStatus:
        return ExperimentStatus(
            id=self.id,
            namespace=self.namespace,
            name=self.name,
            phase=self.phase,
            step=self.step,
            max_steps=self.max_steps,
            reward=self.reward,
            rollout_tokens=self.rollout_tokens,
            train_tokens=self.train_tokens,
            checkpoint=self.checkpoint,
            adapter_path=self.adapter_path,
            error=self.error,
            started_at=self.started_at,
            updated_at=self.updated_at,
            run_id=self.run_id,
        )


@dataclass
class _CompletionJob:
    slot_name: str | None  # experiment id, or None for the base model
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    n: int
    done: threading.Event = field(default_factory=threading.Event)
    result: list[Completion] = field(default_factory=list)
    error: Exception | None = None


@dataclass
class _Rollout:
    exp: Experiment
    prompts: list[Prompt]  # one per completion (each prompt repeated groupSize times)
    requests: list[RolloutRequest]
    completions: list[Completion] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    train_tokens: int = 0

    @property
    def rollout_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)


class Engine:
    """Implements :class:`loraplex_engine.api_types.EngineService`."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_adapters: int,
        max_rank: int,
        checkpoint_root: str | Path,
        rollout_backend: str = "torch",
        device: str = "cpu",
        train_mode: str = "fused",
        micro_batch_tokens: int = 4096,
        model_name: str | None = None,
        vllm_options: dict[str, Any] | None = None,
        ignore_eos: bool = False,
        max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS,
        share_prompt_prefix: bool = True,
    ) -> None:
        if rollout_backend not in ("torch", "vllm"):
            raise ValueError(f"rollout backend must be torch or vllm, got {rollout_backend!r}")
        if train_mode not in ("fused", "timesliced"):
            raise ValueError(f"train_mode must be fused or timesliced, got {train_mode!r}")
        self.model_dir = Path(model_dir)
        self.model_name = model_name or self.model_dir.name
        self.rollout_backend = rollout_backend
        self.device = torch.device(device)
        self.train_mode = train_mode
        self.micro_batch_tokens = micro_batch_tokens
        # Benchmarks: every rollout generates exactly maxNewTokens (equal token counts).
        self.ignore_eos = ignore_eos
        self.max_step_tokens = max_step_tokens
        self.checkpoint_root = Path(checkpoint_root)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        base.to(self.device).eval()
        self.model = MultiLoRAModel(
            base, max_adapters=max_adapters, max_rank=max_rank, target_modules=_targets(base)
        )
        self.optimizer = PerAdapterAdamW(self.model)
        # Training computes each prompt group's prompt once per micro-batch (training.py);
        # off on request or for a model whose cached forward is not known to be exact.
        self._shared_forward: SharedForward | None = None
        if share_prompt_prefix:
            why_not = prefix_sharing_unsupported(base)
            if why_not is None:
                self._shared_forward = shared_prefix_forward(self.model, self.device)
            else:
                log.warning("prompt-prefix sharing off (%s): training recomputes prompts", why_not)
        else:
            log.info("prompt-prefix sharing off (share_prompt_prefix=False)")
        self.share_prompt_prefix = self._shared_forward is not None
        # Tokens through the policy forward (a shared prompt counted once), for benchmarks;
        # the per-experiment trainTokens count prompt + completion per row.
        self.computed_train_tokens = 0
        self.backend = self._make_backend(rollout_backend, vllm_options or {})
        self._experiments: dict[str, Experiment] = {}
        self._model_lock = threading.RLock()  # held for a whole tick and for mutations
        self._state_lock = threading.Lock()  # guards the dict for quick reads
        self._jobs: list[_CompletionJob] = []
        self._jobs_lock = threading.Lock()
        self._host_buffers: dict[int, dict[str, torch.Tensor]] = {}  # time-sliced mode only
        self.work_available = threading.Event()  # set when a tick would have work
        self._ready = True

    def _make_backend(self, name: str, options: dict[str, Any]) -> RolloutBackend:
        if name == "torch":
            return TorchRollout(
                self.model.route,
                self._decode_forward,
                self._pad,
                None if self.ignore_eos else self.tokenizer.eos_token_id,
            )
        return VLLMRolloutBackend(
            self.model_dir,
            lambda exp_id, path: ckpt.save_adapter(self.model, exp_id, path, str(self.model_dir)),
            max_adapters=self.model.max_adapters,
            max_rank=self.model.max_rank,
            ignore_eos=self.ignore_eos,
            **options,
        )

    def close(self) -> None:
        """Stop the rollout backend's worker, if it has one."""
        self.backend.close()

    # ---- EngineService: reads ---------------------------------------------------------

    def is_ready(self) -> bool:
        return self._ready

    def get_experiment(self, exp_id: str) -> ExperimentStatus:
        with self._state_lock:
            exp = self._experiments.get(exp_id)
            if exp is None:
                raise NotFoundError(f"no experiment {exp_id!r} on this engine")
            return exp.status()

    def list_experiments(self) -> list[ExperimentStatus]:
        with self._state_lock:
            return [e.status() for e in self._experiments.values()]

    def capacity(self) -> Capacity:
        import psutil

        with self._state_lock:
            ids = sorted(self._experiments)
        device_bytes = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        return Capacity(
            model=self.model_name,
            rollout_backend=self.rollout_backend,
            max_adapters=self.model.max_adapters,
            max_rank=self.model.max_rank,
            used_slots=len(ids),
            experiments=ids,
            rss_bytes=psutil.Process().memory_info().rss,
            device_bytes=device_bytes,
        )

    # ---- EngineService: mutations (between ticks) -------------------------------------

    def put_experiment(
        self,
        exp_id: str,
        spec: ExperimentSpec,
        namespace: str = "default",
        name: str | None = None,
        resume_from: str | None = None,
        run_id: str | None = None,
    ) -> tuple[ExperimentStatus, bool]:
        if run_id is not None and not ckpt.valid_run_id(run_id):
            raise InvalidRequestError(
                f"runId {run_id!r} must be 1-64 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit",
                field="runId",
            )
        with self._model_lock:
            existing = self._experiments.get(exp_id)
            if existing is not None:
                if _adapter_spec(existing.spec) != _adapter_spec(spec):
                    raise ConflictError(
                        f"experiment {exp_id!r} is loaded with a different spec; "
                        "DELETE it first to change its spec"
                    )
                if run_id is not None and run_id != existing.run_id:
                    raise ConflictError(
                        f"experiment {exp_id!r} is loaded as run {existing.run_id!r}, "
                        f"not runId {run_id!r}; DELETE it first to start another run"
                    )
                return existing.status(), False
            exp = self._load(exp_id, spec, namespace, name or exp_id, resume_from, run_id)
            try:
                self.backend.add_adapter(exp_id)
            except Exception:
                self.optimizer.remove_adapter(exp_id)
                self.model.remove_adapter(exp_id)
                raise
            with self._state_lock:
                self._experiments[exp_id] = exp
            self.work_available.set()
            return exp.status(), True

    def checkpoint_experiment(self, exp_id: str) -> CheckpointRef:
        with self._model_lock:
            exp = self._require(exp_id)
            if exp.phase == "Failed":
                raise ConflictError(f"experiment {exp_id!r} failed; its last checkpoint stands")
            return self._checkpoint(exp)

    def remove_experiment(self, exp_id: str) -> ExperimentStatus:
        with self._model_lock:
            exp = self._require(exp_id)
            if exp.phase != "Failed" and (
                exp.checkpoint is None or exp.checkpoint.step != exp.step
            ):
                self._checkpoint(exp)
            self.backend.remove_adapter(exp_id)
            self.optimizer.remove_adapter(exp_id)
            self.model.remove_adapter(exp_id)
            with self._state_lock:
                del self._experiments[exp_id]
            return exp.status()

    def complete(
        self, model: str, prompt: str, max_tokens: int, temperature: float, n: int
    ) -> list[str]:
        """Served by the next tick, inside its rollout batch."""
        if model not in (self.model_name, *self._experiments):
            raise NotFoundError(f"no model {model!r}: use an experiment id or {self.model_name!r}")
        ids = self.tokenizer(prompt).input_ids or [self.tokenizer.bos_token_id]
        job = _CompletionJob(
            None if model == self.model_name else model, ids, max_tokens, temperature, n
        )
        with self._jobs_lock:
            self._jobs.append(job)
            self.work_available.set()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return [self._decode(c.token_ids) for c in job.result]

    # ---- the tick ---------------------------------------------------------------------

    def tick(self) -> TickReport | None:
        with self._model_lock:
            running = [e for e in self._experiments.values() if e.phase == "Running"]
            with self._jobs_lock:  # drain and clear together: no wake-up is lost
                jobs, self._jobs = self._jobs, []
                if not running and not jobs:
                    self.work_available.clear()
                    return None
            return self._tick(running, jobs)

    def _tick(self, running: list[Experiment], jobs: list[_CompletionJob]) -> TickReport:
        start = time.perf_counter()
        phases = dict.fromkeys(PHASES, 0.0)
        reports: dict[str, ExperimentTick] = {}

        def timed(phase: str, fn: Callable[[], Any]) -> Any:
            t = time.perf_counter()
            try:
                return fn()
            finally:
                phases[phase] += time.perf_counter() - t

        rollouts = [self._plan_rollout(e) for e in running]
        timed("rollout", lambda: self._rollout(rollouts, jobs))
        timed("reward", lambda: [self._score(r, reports) for r in rollouts])
        live = [r for r in rollouts if r.exp.phase == "Running"]
        timed("train", lambda: self._train(live, reports))
        synced = [r.exp.id for r in live if r.exp.phase == "Running"]
        timed("sync", lambda: self.backend.sync_adapters(synced))
        timed("checkpoint", lambda: [self._after_step(r, reports) for r in live])
        return TickReport(
            seconds=time.perf_counter() - start,
            phase_seconds=phases,
            experiments=list(reports.values()),
        )

    # ---- rollout and reward -----------------------------------------------------------

    def _plan_rollout(self, exp: Experiment) -> _Rollout:
        alg, roll = exp.spec.algorithm, exp.spec.rollout
        slot = self.model.slot_of(exp.id)
        prompts = exp.task.sample_prompts(alg.prompts_per_step, exp.prompt_rng)
        expanded = [p for p in prompts for _ in range(alg.group_size)]
        requests = [
            RolloutRequest(
                slot=slot,
                prompt_ids=self._encode(p.text),
                max_new_tokens=roll.max_new_tokens,
                temperature=roll.temperature,
                generator=exp.sample_gen,
                group=exp.id,
                adapter=exp.id,
            )
            for p in expanded
        ]
        return _Rollout(exp, expanded, requests)

    def _rollout(self, rollouts: list[_Rollout], jobs: list[_CompletionJob]) -> None:
        requests = [req for r in rollouts for req in r.requests]
        job_rows: list[tuple[_CompletionJob, int]] = []
        for job in jobs:
            try:
                slot = 0 if job.slot_name is None else self.model.slot_of(job.slot_name)
            except AdapterError as e:
                job.error = NotFoundError(str(e))
                job.done.set()
                continue
            job_rows.append((job, len(requests)))
            requests += [
                RolloutRequest(
                    slot,
                    job.prompt_ids,
                    job.max_tokens,
                    job.temperature,
                    group="~job",
                    adapter=job.slot_name,
                )
                for _ in range(job.n)
            ]
        outputs = self.backend.generate(requests)
        offset = 0
        for r in rollouts:
            r.completions = outputs[offset : offset + len(r.requests)]
            offset += len(r.requests)
        for job, first in job_rows:
            job.result = outputs[first : first + job.n]
            job.done.set()

    def _decode_forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, past: Any
    ) -> tuple[torch.Tensor, Any]:
        """One decoding step of the base model; the caller has set the row routing."""
        out = self.model.base_model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            past_key_values=past,
            use_cache=True,
        )
        return out.logits[:, -1].float().cpu(), out.past_key_values

    def _score(self, r: _Rollout, reports: dict[str, ExperimentTick]) -> None:
        if any(c.nonfinite for c in r.completions):
            self._fail(
                r.exp, "non-finite logits from the adapter (diverged)", "non_finite", reports
            )
            return
        texts = [self._decode(c.token_ids) for c in r.completions]
        try:
            rewards = r.exp.task.score(r.prompts, texts)
            bad = [x for x in rewards if not math.isfinite(x)]
            if bad:
                raise RewardError(f"reward returned a non-finite score ({bad[0]})")
        except (RewardError, TaskError, ValueError, TypeError) as e:
            self._fail(r.exp, f"reward failed: {e}", "reward_error", reports)
            return
        r.rewards = rewards

    # ---- training ---------------------------------------------------------------------

    def _train(self, live: list[_Rollout], reports: dict[str, ExperimentTick]) -> None:
        if not live:
            return
        rows, updates = self._train_rows(live)
        self.model.train()
        try:
            if self.train_mode == "fused":
                self.optimizer.zero_grad()
                self._backward(rows, updates)
                self._step_finite([r.exp for r in live], reports)
            else:
                for r in live:
                    self._train_timesliced(
                        r.exp, [x for x in rows if x.experiment == r.exp.id], updates, reports
                    )
        finally:
            self.model.eval()
        for r in live:
            r.train_tokens = sum(x.length for x in rows if x.experiment == r.exp.id)

    def _train_rows(
        self, live: list[_Rollout]
    ) -> tuple[list[TrainRow], dict[str, ExperimentUpdate]]:
        rows: list[TrainRow] = []
        updates: dict[str, ExperimentUpdate] = {}
        for r in live:
            alg = r.exp.spec.algorithm
            updates[r.exp.id] = ExperimentUpdate(r.exp.algorithm, alg.clip, alg.kl_coef)
            adv = r.exp.algorithm.advantages(torch.tensor(r.rewards), alg.group_size)
            slot = self.model.slot_of(r.exp.id)
            # Prompt group = identical prompt tokens within this experiment's step (its
            # groupSize samples, and any prompt drawn twice): they share one prefix.
            groups: dict[tuple[int, ...], int] = {}
            for req, comp, a in zip(r.requests, r.completions, adv.tolist(), strict=True):
                if comp.token_ids:
                    group = groups.setdefault(tuple(req.prompt_ids), len(groups))
                    rows.append(
                        TrainRow(
                            r.exp.id,
                            slot,
                            req.prompt_ids,
                            comp.token_ids,
                            comp.logprobs,
                            a,
                            req.temperature,
                            group,
                        )
                    )
        return rows, updates

    def _backward(self, rows: list[TrainRow], updates: dict[str, ExperimentUpdate]) -> None:
        stats = fused_backward(
            self._routed_forward,
            rows,
            updates,
            self._pad,
            self.micro_batch_tokens,
            self._shared_forward,
        )
        self.computed_train_tokens += stats.computed_tokens

    def _routed_forward(
        self, ids: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            slot_ids=slots.to(self.device),
        )
        # Logits stay on the device: the loss and its backward run there (the batch
        # tensors follow the logits, training._logprobs).
        return out.logits.float()

    def _step_finite(self, exps: list[Experiment], reports: dict[str, ExperimentTick]) -> None:
        """Optimiser step for every adapter whose gradient is finite; fail the others."""
        slots = []
        mine = [self.model.slot_of(exp.id) for exp in exps]
        grad_ok = self._finite_slots(
            (p.grad for p in self.optimizer.params if p.grad is not None), mine
        )
        for exp in exps:
            slot = self.model.slot_of(exp.id)
            if grad_ok[slot]:
                slots.append(slot)
            else:
                self._clear_grad(slot)
                self._fail(exp, "non-finite gradient (loss diverged)", "non_finite", reports)
        self.optimizer.step(slots)
        weights_ok = self._finite_slots((p.data for p in self.optimizer.params), mine)
        for exp in exps:
            if exp.phase == "Running" and not weights_ok[self.model.slot_of(exp.id)]:
                self._fail(
                    exp, "non-finite adapter weights after the update", "non_finite", reports
                )

    def _train_timesliced(
        self,
        exp: Experiment,
        rows: list[TrainRow],
        updates: dict[str, ExperimentUpdate],
        reports: dict[str, ExperimentTick],
    ) -> None:
        """The published baseline: one adapter at a time, swapped in from host buffers."""
        slot = self.model.slot_of(exp.id)
        self._swap(slot, to_device=True)
        self.optimizer.zero_grad()
        self._backward(rows, updates)
        self._step_finite([exp], reports)
        self._swap(slot, to_device=False)

    def _swap(self, slot: int, to_device: bool) -> None:
        """Real copies of one slot's weights and moments to/from host buffers."""
        buffers = self._host_buffers.setdefault(slot, {})
        for key, tensor in self._slot_tensors(slot).items():
            if to_device and key in buffers:
                tensor.copy_(buffers[key], non_blocking=True)
            elif not to_device:
                buffers[key] = tensor.detach().to("cpu", copy=True)

    def _slot_tensors(self, slot: int) -> dict[str, torch.Tensor]:
        """Views of what one adapter owns: its rank's rows of A and columns of B, and their
        moments, in the layers it targets. A one-adapter-at-a-time system swaps exactly
        this; copying the whole stacked slot would overcharge the baseline."""
        tensors: dict[str, torch.Tensor] = {}
        for path, layer in self.model.lora_layers.items():
            r = layer.rank_of(slot)
            if not r:
                continue
            for pname, p, part in (
                ("A", layer.lora_A, (slot, slice(0, r))),
                ("B", layer.lora_B, (slot, slice(None), slice(0, r))),
            ):
                tensors[f"{path}.{pname}"] = p.data[part]
                tensors[f"{path}.{pname}.m"] = self.optimizer.exp_avg[p][part]
                tensors[f"{path}.{pname}.v"] = self.optimizer.exp_avg_sq[p][part]
        return tensors

    def _finite_slots(self, tensors: Any, slots: list[int]) -> dict[int, bool]:
        """Per slot in ``slots``: every entry of the stacked tensors finite. One check per
        tensor over the slice of slots in play (a view), one host sync in all, instead of
        one sync per slot and tensor (~5,700 tiny checks per tick at 8 adapters)."""
        lo, hi = min(slots), max(slots) + 1
        ok = torch.ones(hi - lo, dtype=torch.bool, device=self.device)
        for t in tensors:
            ok &= torch.isfinite(t[lo:hi]).flatten(1).all(1)
        flags = ok.tolist()
        return {s: flags[s - lo] for s in slots}

    def _clear_grad(self, slot: int) -> None:
        for p in self.optimizer.params:
            if p.grad is not None:
                p.grad[slot].zero_()

    # ---- bookkeeping and checkpoints --------------------------------------------------

    def _after_step(self, r: _Rollout, reports: dict[str, ExperimentTick]) -> None:
        exp = r.exp
        if exp.phase != "Running":
            return
        exp.step += 1
        exp.reward = sum(r.rewards) / len(r.rewards)
        exp.rollout_tokens += r.rollout_tokens
        exp.train_tokens += r.train_tokens
        exp.updated_at = _now()
        finished = exp.max_steps > 0 and exp.step >= exp.max_steps
        due = exp.step % exp.spec.checkpoint.every_steps == 0
        tick = ExperimentTick(
            exp.id, exp.namespace, exp.step, exp.reward, r.rollout_tokens, r.train_tokens
        )
        if finished or due:
            self._checkpoint(exp)
            tick.checkpointed = True
        if finished:
            exp.phase = "Succeeded"
        reports[exp.id] = tick

    def _run_dir(self, namespace: str, name: str, run_id: str) -> Path:
        return self.checkpoint_root / namespace / name / run_id

    def _checkpoint(self, exp: Experiment) -> CheckpointRef:
        """Adapter (PEFT) + trainer state, written atomically into the run's own directory;
        keep its newest K. Other runs' directories (a deleted experiment of the same name)
        are never touched."""
        exp_dir = self._run_dir(exp.namespace, exp.name, exp.run_id)
        target = exp_dir / f"step-{exp.step:08d}"
        with ckpt.atomic_dir(target, overwrite=True) as tmp:
            ckpt.save_adapter(self.model, exp.id, tmp, base_model_name_or_path=str(self.model_dir))
            ckpt.save_trainer_state(
                tmp, self.optimizer, exp.id, exp.sample_gen, metadata=self._metadata(exp)
            )
        exp.checkpoint = CheckpointRef(str(target), exp.step)
        exp.adapter_path = str(target)
        self._prune(exp_dir, exp.spec.checkpoint.keep)
        return exp.checkpoint

    def _metadata(self, exp: Experiment) -> dict[str, Any]:
        return {
            "experiment": exp.id,
            ckpt.RUN_ID: exp.run_id,
            "step": exp.step,
            "reward": exp.reward,
            "rolloutTokens": exp.rollout_tokens,
            "trainTokens": exp.train_tokens,
            "promptRng": _encode_random_state(exp.prompt_rng),
            "spec": exp.spec.model_dump(by_alias=True, mode="json"),
        }

    @staticmethod
    def _prune(run_dir: Path, keep: int) -> None:
        for old in ckpt.step_dirs(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    def _fail(
        self, exp: Experiment, reason: str, kind: str, reports: dict[str, ExperimentTick]
    ) -> None:
        exp.phase, exp.error, exp.updated_at = "Failed", reason, _now()
        reports[exp.id] = ExperimentTick(
            exp.id, exp.namespace, exp.step, exp.reward or 0.0, 0, 0, failed_reason=kind
        )

    # ---- loading ----------------------------------------------------------------------

    def _load(
        self,
        exp_id: str,
        spec: ExperimentSpec,
        namespace: str,
        name: str,
        resume_from: str | None,
        run_id: str | None,
    ) -> Experiment:
        """Build everything first, then touch the model: a failure changes nothing."""
        config = LoRAConfig(
            rank=spec.lora.rank,
            alpha=spec.lora.alpha,
            dropout=spec.lora.dropout,
            target_modules=tuple(spec.lora.target_modules),
        )
        try:
            self.model.check_config(config)
        except AdapterError as e:
            raise InvalidSpecError(str(e), field=_adapter_field(e)) from e
        self._check_step_work(spec)
        if not self.model.free_slots():
            raise NoCapacityError(f"all {self.model.max_adapters} adapter slots are taken")
        try:
            task = build_task(
                spec.task.name,
                spec.task.params,
                spec.task.dataset,
                spec.task.reward or "default",
                spec.task.reward_url,
            )
            algorithm = get_algorithm(spec.algorithm.name)
        except TaskError as e:
            raise InvalidSpecError(e.message, field=e.field) from e
        except KeyError as e:
            raise InvalidSpecError(str(e), field="spec.algorithm.name") from e
        seed = spec.algorithm.seed
        exp = Experiment(
            id=exp_id,
            namespace=namespace,
            name=name,
            spec=spec,
            task=task,
            algorithm=algorithm,
            prompt_rng=random.Random(seed),
            sample_gen=torch.Generator().manual_seed(seed),
        )
        if run_id is not None:
            exp.run_id = run_id
        settings = AdamWSettings(lr=spec.algorithm.learning_rate, weight_decay=0.0)
        try:
            if resume_from:
                self._resume(exp, config, Path(resume_from), run_id)
            elif run_id is None or not self._resume_run(exp, config):
                self.model.add_adapter(exp_id, config, seed=seed)
                self.optimizer.add_adapter(exp_id, settings)
        except NoFreeSlotError as e:
            raise NoCapacityError(str(e)) from e
        return exp

    def _check_step_work(self, spec: ExperimentSpec) -> None:
        alg = spec.algorithm
        work = alg.group_size * alg.prompts_per_step * spec.rollout.max_new_tokens
        if work > self.max_step_tokens:
            raise InvalidSpecError(
                f"groupSize x promptsPerStep x maxNewTokens = {work} rollout tokens per step "
                f"exceeds this engine's limit of {self.max_step_tokens}; lower one of them",
                field="spec.algorithm.promptsPerStep",
            )

    def _resume(
        self, exp: Experiment, config: LoRAConfig, requested: Path, run_id: str | None
    ) -> None:
        """Resume from the newest intact checkpoint of the requested one's run at or after
        its step: one written after the caller last looked (e.g. on SIGTERM) is not
        redone. A broken newer one is skipped (and kept); the requested one's own error
        is the one reported. With ``run_id`` the requested checkpoint must belong to that
        run, unless it is from before run directories (then the run adopts it)."""
        try:
            own = ckpt.Candidate(requested, ckpt.read_metadata(requested))
        except CheckpointError:
            own = ckpt.Candidate(requested, None)  # loading it reports what is wrong with it
        own_run = ckpt.run_of(own.metadata)
        if (
            run_id is not None
            and own_run not in (None, run_id)
            and ckpt.in_run_dir(requested, own_run)
        ):
            raise BadCheckpointError(
                f"resumeFrom {requested} belongs to run {own_run!r}, not to runId "
                f"{run_id!r}: name a checkpoint of run {run_id!r}, or leave out "
                "resumeFrom to resume that run's newest checkpoint",
                field="resumeFrom",
            )
        for path in self._resume_order(exp, own, run_id or own_run):
            try:
                meta = self._load_checkpoint(exp, config, path)
            except CheckpointError as e:
                if path == requested:
                    raise BadCheckpointError(str(e), field="resumeFrom") from e
                log.warning("resume of %s: skipping newer checkpoint %s: %s", exp.id, path, e)
                continue
            # A checkpoint from before run ids keeps the fresh id: later resumes find its
            # successors in that run's directory.
            exp.run_id = run_id or ckpt.run_of(meta) or exp.run_id
            return

    def _resume_order(self, exp: Experiment, own: ckpt.Candidate, run: str | None) -> list[Path]:
        """Candidates, ordered by ckpt.resume_order: the step directories beside the
        requested one and, when the run is known, in the run's own directory (they differ
        when the requested checkpoint is from before run directories)."""
        step = own.metadata.get("step") if own.metadata else None
        if not isinstance(step, int):
            return [own.path]
        dirs = [own.path.parent]
        if run is not None:
            dirs.append(self._run_dir(exp.namespace, exp.name, run))
        seen = {os.path.realpath(own.path)}
        siblings = []
        for path in (p for d in dirs for p in ckpt.step_dirs(d) if ckpt.dir_step(p) > step):
            real = os.path.realpath(path)
            if real in seen:
                continue
            seen.add(real)
            try:
                siblings.append(ckpt.Candidate(path, ckpt.read_metadata(path)))
            except CheckpointError as e:  # may be this run's, but it cannot be told: skip it
                log.warning("resume from %s: skipping newer checkpoint: %s", own.path, e)
        return ckpt.resume_order(own, siblings, run)

    def _resume_run(self, exp: Experiment, config: LoRAConfig) -> bool:
        """Resume run ``exp.run_id`` from the newest intact checkpoint in its directory;
        False when it has none (a fresh start). A run whose directory holds checkpoints
        none of which loads is refused rather than restarted over them."""
        run_dir = self._run_dir(exp.namespace, exp.name, exp.run_id)
        found = ckpt.step_dirs(run_dir)
        if not found:
            return False
        candidates = []
        for path in found:
            try:
                candidates.append(ckpt.Candidate(path, ckpt.read_metadata(path)))
            except CheckpointError as e:
                log.warning("resume of run %s: skipping checkpoint: %s", exp.run_id, e)
        first_error = f"no checkpoint of run {exp.run_id!r} among {[p.name for p in found]}"
        for i, path in enumerate(ckpt.run_order(exp.run_id, candidates)):
            try:
                self._load_checkpoint(exp, config, path)
                return True
            except CheckpointError as e:
                log.warning("resume of run %s: skipping checkpoint %s: %s", exp.run_id, path, e)
                if i == 0:
                    first_error = str(e)
        raise BadCheckpointError(
            f"runId {exp.run_id!r}: {run_dir} holds checkpoints but none of them loads "
            f"({first_error}); it is not restarted over them",
            field="runId",
        )

    def _load_checkpoint(self, exp: Experiment, config: LoRAConfig, path: Path) -> dict[str, Any]:
        """Load one checkpoint into ``exp`` (returns its metadata); a CheckpointError
        leaves nothing loaded."""
        saved = ckpt.read_adapter_config(path)
        if saved != config:
            raise CheckpointError(f"{path}: checkpoint has {saved}, the spec asks for {config}")
        ckpt.load_adapter(self.model, exp.id, path)
        try:
            # torch's global RNG (dropout masks) is shared by every tenant: restore the
            # saved one only when this experiment will be alone on the engine, so a
            # resume never reshuffles the masks of experiments already training.
            meta = ckpt.load_trainer_state(
                path, self.optimizer, exp.id, exp.sample_gen, global_rng=not self._experiments
            )
        except CheckpointError:
            self.model.remove_adapter(exp.id)
            raise
        self.optimizer.set_lr(exp.id, exp.spec.algorithm.learning_rate)
        exp.step = int(meta.get("step", 0))
        exp.reward = meta.get("reward")
        exp.rollout_tokens = int(meta.get("rolloutTokens", 0))
        exp.train_tokens = int(meta.get("trainTokens", 0))
        if "promptRng" in meta:
            exp.prompt_rng.setstate(_decode_random_state(meta["promptRng"]))
        exp.checkpoint = CheckpointRef(str(path), exp.step)
        exp.adapter_path = str(path)
        if exp.max_steps and exp.step >= exp.max_steps:
            exp.phase = "Succeeded"
        return meta

    def _require(self, exp_id: str) -> Experiment:
        exp = self._experiments.get(exp_id)
        if exp is None:
            raise NotFoundError(f"no experiment {exp_id!r} on this engine")
        return exp

    # ---- tokens -----------------------------------------------------------------------

    @property
    def _pad(self) -> int:
        return self.tokenizer.pad_token_id

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids or [self.tokenizer.bos_token_id]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _targets(base: torch.nn.Module) -> list[str]:
    """Every linear projection, plus the output head when untied (LoRA on lm_head is what
    lets a tiny random model learn a task quickly; tied heads stay frozen)."""
    names = {
        path.rsplit(".", 1)[-1]
        for path, mod in base.named_modules()
        if type(mod) is torch.nn.Linear
    }
    head = base.get_output_embeddings()
    tied = head is not None and head.weight is base.get_input_embeddings().weight
    if tied:
        names.discard(_head_name(base))
    return sorted(names)


def _head_name(base: torch.nn.Module) -> str:
    head = base.get_output_embeddings()
    return next(p.rsplit(".", 1)[-1] for p, m in base.named_modules() if m is head)


def _adapter_field(error: AdapterError) -> str:
    if isinstance(error, RankTooLargeError):
        return "spec.lora.rank"
    if isinstance(error, UnknownTargetModuleError):
        return "spec.lora.targetModules"
    return "spec.lora"


def _encode_random_state(rng: random.Random) -> list[Any]:
    version, state, gauss = rng.getstate()
    return [version, list(state), gauss]


def _decode_random_state(raw: list[Any]) -> tuple[Any, ...]:
    version, state, gauss = raw
    return (version, tuple(state), gauss)


def _adapter_spec(spec: ExperimentSpec) -> dict[str, Any]:
    """The spec minus operator-only fields (pool, priority, suspend): what the engine runs."""
    return spec.model_dump(exclude={"engine_pool", "priority", "suspend"})
