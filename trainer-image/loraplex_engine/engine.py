"""The hot engine: one frozen base model, one adapter slot per experiment, and a tick
that advances every running experiment by one RL step at once.

The Engine is the API (:class:`~loraplex_engine.spec.service.EngineService`) over its parts:
the model with its adapter slots (lora/model.py), the run store (store/run_store.py:
checkpoint layout, resume, keep-K), the tick's phase pipeline (tick/tick.py), the training
strategy (train/strategy.py) and the rollout backend (rollout/). Experiments join and
leave between ticks (``_model_lock``); reads (status, capacity) never wait for a tick.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import psutil
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from loraplex_engine.base_model import model_shape_of
from loraplex_engine.clients.experiments import ClientExperimentAPI, ClientExperiments
from loraplex_engine.clients.models import ClientModels
from loraplex_engine.completion_jobs import CompletionJob, resolve
from loraplex_engine.environments.observations import check_chat_templates
from loraplex_engine.experiment import Experiment, new_experiment
from loraplex_engine.lora.grouped import KERNEL_MODES
from loraplex_engine.lora.model import MultiLoRAModel, adaptable_module_names, decode_forward
from loraplex_engine.lora.precision import MASTER_DTYPE, dtype_name, enable_tf32, resolve_dtype
from loraplex_engine.memory.capacity_plan import engine_plan
from loraplex_engine.parallel.data_parallel import data_parallel_trainer, share_rollouts
from loraplex_engine.parallel.distributed import World
from loraplex_engine.parallel.sharding import shard_engine_base
from loraplex_engine.plan.experiment import ExperimentPlan, compile_plan
from loraplex_engine.plan.limits import EngineLimits
from loraplex_engine.plugins.discovery import installed
from loraplex_engine.rollout.backends import TorchRollout
from loraplex_engine.rollout.select import RolloutParts, build_rollout
from loraplex_engine.settings.engine import EngineSettings
from loraplex_engine.spec.api_types import (
    DEFAULT_MICRO_BATCH_TOKENS,
    DEFAULT_ROLLOUT_KV_TOKENS,
    AdapterSyncStats,
    Capacity,
    CheckpointRef,
    ExperimentStatus,
    MemoryUse,
    TickReport,
)
from loraplex_engine.spec.errors import (
    ConflictError,
    InvalidRequestError,
    NoCapacityError,
    NoFreeSlotError,
    NotFoundError,
    UnavailableError,
)
from loraplex_engine.spec.experiment import ExperimentSpec
from loraplex_engine.spec.service import PromptJob, ServedRow
from loraplex_engine.store import checkpoint as ckpt
from loraplex_engine.store.quota import CheckpointQuota
from loraplex_engine.store.run_store import RunStore, valid_run_id
from loraplex_engine.store.versions import VersionStore
from loraplex_engine.tenancy.admissions import KeyedLocks
from loraplex_engine.tenancy.trust import TrustPolicy
from loraplex_engine.tenancy.work_limits import WorkLimits
from loraplex_engine.tick.fair_share import RewardScorer
from loraplex_engine.tick.pipelined import tick_class
from loraplex_engine.tick.time_share import TimeShare, take_in_turn
from loraplex_engine.tokens import TokenCodec
from loraplex_engine.train.optim import PerAdapterAdamW
from loraplex_engine.train.shared_prefix import shared_forward_of
from loraplex_engine.train.strategy import AdapterTrainer, FusedTraining, TrainingStrategy
from loraplex_engine.versions.publisher import Publisher
from loraplex_engine.versions.service import Versions

log = logging.getLogger("loraplex_engine.engine")

# How long a completion request waits for a tick to serve it: a tick that cannot (the loop
# stopped, the engine is shutting down) must not hold a request thread for ever.
COMPLETION_TIMEOUT_S = 300.0


class Engine(ClientExperimentAPI, Versions):
    """Implements :class:`loraplex_engine.spec.service.TickingEngine`; its ``clients``
    (clients/models.py) implement :class:`loraplex_engine.spec.training_service.TrainingService`.

    ``settings`` (settings/engine.py, each field's help says what it does) configure it;
    the rest is what the process running it knows: ``device`` (resolved: ``cuda:1``, not
    ``auto``), ``world`` (this process's rank in a data-parallel group,
    parallel/data_parallel.py) and ``trust`` (what tenants' datasets and reward URLs may
    reach); ``model_name``, ``ignore_eos`` and ``share_prompt_prefix`` are the
    benchmarks' knobs."""

    def __init__(
        self,
        model_dir: str | Path,
        settings: EngineSettings,
        *,
        device: str = "cpu",
        world: World | None = None,
        trust: TrustPolicy | None = None,
        model_name: str | None = None,
        ignore_eos: bool = False,
        share_prompt_prefix: bool = True,
    ) -> None:
        s = self.settings = settings  # validated: settings/engine.py
        micro_batch_tokens, rollout_kv_tokens = s.micro_batch_tokens, s.rollout_kv_tokens
        self.model_dir = Path(model_dir)
        self.model_name = model_name or self.model_dir.name
        self.rollout_backend = s.rollout_backend
        self.device = torch.device(device)
        self.dtype = resolve_dtype(s.dtype, self.device)
        enable_tf32(self.device)
        self.train_mode = s.train_mode
        # Benchmarks: every rollout generates exactly maxNewTokens (equal token counts).
        self.ignore_eos = ignore_eos
        self.max_step_tokens = s.max_step_tokens
        self.max_prompt_tokens = s.max_prompt_tokens
        # What tenants' data and rewards may reach (tenancy/trust.py; default: the strictest).
        self.trust = trust or TrustPolicy()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype)
        # generation_config.json's eos_token_id: an int, a list (Llama 3) or none.
        eos = getattr(getattr(base, "generation_config", None), "eos_token_id", None)
        self.codec = TokenCodec(self.tokenizer, eos)
        base.to(self.device).eval()
        self.model = MultiLoRAModel(
            base,
            max_adapters=s.max_adapters,
            max_rank=s.max_rank,
            target_modules=adaptable_module_names(base),
            dtype=MASTER_DTYPE,
            grouped_mm=KERNEL_MODES[s.lora_kernel],
        )
        self.lockstep = shard_engine_base(self.model, world, self.device) if s.shard_base else None
        share_prompt_prefix = share_prompt_prefix and self.lockstep is None
        self.optimizer = PerAdapterAdamW(self.model)
        root, quota = Path(s.checkpoint_root), s.checkpoint_quota_bytes
        quota = CheckpointQuota(quota) if quota is not None else None
        self.store = RunStore(
            root, self.model, self.optimizer, str(self.model_dir), quota, s.checkpoint_keep_runs
        )
        shared = shared_forward_of(self.model, self.device, share_prompt_prefix)
        self.share_prompt_prefix = shared is not None
        gradient_checkpointing = s.gradient_checkpointing
        if gradient_checkpointing is None:
            gradient_checkpointing = self.device.type == "cuda"
        # Chosen once; from here on the engine asks the backend what it is (rollout/select.py).
        self.backend = build_rollout(
            s.rollout_backend,
            RolloutParts(
                self.model,
                self.model_dir,
                self.device,
                self.dtype,
                self.model.route,
                decode_forward(self.model, self.device),
                ckpt.peft_export(self.model, str(self.model_dir)),
                self.codec.pad_id,
                self.codec.eos_ids,
                self.ignore_eos,
                self.max_prompt_tokens,
                self.max_step_tokens,
                dict(s.vllm_options),
                world,
                self.lockstep,
            ),
        )
        trainer: type[AdapterTrainer] = FusedTraining
        if s.train_mode == "timesliced":  # the benchmark's baseline arm: dev code, on request
            from loraplex_engine.dev.timesliced import TimeSlicedTraining

            trainer = TimeSlicedTraining
        if world is not None:  # data parallel over the process group (parallel/data_parallel.py)
            trainer = data_parallel_trainer(world, s.train_mode, self.lockstep)
        self.strategy: TrainingStrategy = trainer(
            self.model,
            self.optimizer,
            self.device,
            self.codec.pad_id,
            micro_batch_tokens or DEFAULT_MICRO_BATCH_TOKENS,
            shared,
            gradient_checkpointing=gradient_checkpointing,
            # A sampler with its own kernels (vLLM): the trainer scores the rows itself
            # (train/strategy.AdapterTrainer).
            recompute_old_logprobs=not self.backend.shares_trainer_weights,
        )
        # Data parallel: rank 0's adapter adds and removes reach the workers (same slots),
        # and every rank decodes a share of each torch rollout.
        self.ranks = share_rollouts(self.strategy, self.backend)
        # Published versions (versions/): from spare slots where one process decodes (torch).
        one = self.ranks is None and self.lockstep is None and self.backend.shares_trainer_weights
        self.publisher = Publisher(VersionStore(root, quota), self.model, self.model_dir, one)
        # Weight syncs to a sampler with its own copy of the adapters (vLLM); torch: None.
        self.adapter_sync = None if self.backend.shares_trainer_weights else AdapterSyncStats()
        # Sized once the weights, slots and rollout worker hold their memory.
        self.memory_plan = engine_plan(
            self.model,
            dtype=self.dtype,
            device=self.device,
            checkpointing=self.strategy.gradient_checkpointing,
            max_prompt_tokens=self.max_prompt_tokens,
            device_bytes=s.device_memory,
            headroom=s.memory_headroom,
            micro_batch_tokens=micro_batch_tokens,
            rollout_kv_tokens=rollout_kv_tokens,
            plan_rollout=self.backend.shares_trainer_weights,  # vLLM sizes its own cache
        )
        self.strategy.micro_batch_tokens = self.memory_plan.micro_batch_tokens
        if isinstance(self.backend, TorchRollout):  # vLLM sizes its own cache
            kv_tokens = self.memory_plan.rollout_kv_tokens or DEFAULT_ROLLOUT_KV_TOKENS
            self.backend.kv_tokens = kv_tokens
            self.memory_plan = self.memory_plan.model_copy(update={"rollout_kv_tokens": kv_tokens})
        self._experiments: dict[str, Experiment] = {}
        self._model_lock = threading.RLock()  # held for a whole tick and for mutations
        self._state_lock = threading.Lock()  # guards the dict for quick reads
        self._jobs: list[CompletionJob] = []
        self._jobs_lock = threading.Lock()
        self.work_available = threading.Event()  # set when a tick would have work
        self._refusing: str | None = None  # why completions are no longer served
        self.scorer = RewardScorer(s.reward_deadline, self._wake)
        self.time_share = TimeShare(s.serving_share)
        # Longest row the base model takes (prompt + completion); None: not stated.
        self.context_tokens: int | None = getattr(base.config, "max_position_embeddings", None)
        self.limits = WorkLimits(s.max_prompt_tokens, s.max_step_tokens, self.context_tokens)
        # What a spec is compiled against (plan/): every engine-side check of it.
        modules = frozenset(self.model.target_modules)
        self.plan_limits = EngineLimits(s.max_rank, modules, self.limits)
        self._tick = tick_class(s.schedule, world)(  # sync, or tick/pipelined.py
            self.model,
            self.codec,
            self.backend,
            self.strategy,
            self.store,
            self.scorer,
            s.max_prompt_tokens,
            self.context_tokens,
            self.publisher,
            wake=self._wake,  # a multi-turn step's environment answered after its tick
        )
        self._tick.attach_streams(self.device, self.memory_plan)  # pipelined: a CUDA side stream
        # Models a client trains itself (clients/).
        self.clients = ClientModels(
            self, s.client_models_per_tick, s.client_tick_gather, s.client_models_per_namespace
        )
        self.client_experiments = ClientExperiments(self.clients)  # spec.client ones
        self.admissions = KeyedLocks()  # one PUT per experiment id at a time

    @property
    def computed_train_tokens(self) -> int:
        """Tokens through the policy forward (a shared prompt counted once), for
        benchmarks; the per-experiment trainTokens count prompt + completion per row."""
        return self.strategy.computed_tokens

    @property
    def queued_completions(self) -> int:  # waiting for a serving tick; read at each scrape
        return len(self._jobs)

    def _wake(self) -> None:
        """Work arrived for the loop (a late reward): under the jobs lock, so the check
        in :meth:`tick` cannot miss it."""
        with self._jobs_lock:
            self.work_available.set()

    def refuse_completions(self, reason: str) -> None:
        """No tick will run again (the loop stopped): answer the queued completions and
        every later one with ``reason`` instead of letting them wait."""
        with self._jobs_lock:
            self._refusing = reason
            jobs, self._jobs = self._jobs, []
        resolve(jobs, UnavailableError(reason))
        self.clients.refuse(reason)

    def close(self) -> None:
        """Answer the completions still queued, stop the reward pool and the rollout
        backend's worker, if it has one."""
        self.refuse_completions("the engine is shutting down")
        self.scorer.close()
        self.backend.close()

    def is_ready(self) -> bool:
        return True  # the constructor returns only once the model and backend are loaded

    def get_task_experiment(self, exp_id: str) -> ExperimentStatus:
        with self._state_lock:
            return self._require(exp_id).status()

    def list_task_experiments(self) -> list[ExperimentStatus]:
        with self._state_lock:
            return [e.status() for e in self._experiments.values()]

    def capacity(self) -> Capacity:
        with self._state_lock:
            ids = sorted([*self._experiments, *self.clients.adapter_names()])
            sync = None if self.adapter_sync is None else self.adapter_sync.model_copy()
            storage_full = self._tick.storage_full_among(self._experiments.values())
        device = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        return Capacity(
            model=self.model_name,
            rollout_backend=self.rollout_backend,
            max_adapters=self.model.max_adapters,
            max_rank=self.model.max_rank,
            dtype=dtype_name(self.dtype),
            gradient_checkpointing=self.strategy.gradient_checkpointing,
            used_slots=len(ids),
            experiments=ids,
            memory=MemoryUse(rss_bytes=psutil.Process().memory_info().rss, device_bytes=device),
            model_shape=model_shape_of(self.model.base_model.config),
            target_modules=sorted(self.model.target_modules),
            plan=self.memory_plan,
            adapter_sync=sync,
            storage_full=storage_full,
            plugins=self.trust.plugins.listing(installed()),  # type: ignore[arg-type]
            **self.publisher.slot_stats(),
        )

    def put_task_experiment(
        self,
        exp_id: str,
        spec: ExperimentSpec,
        namespace: str = "default",
        name: str | None = None,
        resume_from: str | None = None,
        run_id: str | None = None,
    ) -> tuple[ExperimentStatus, bool]:
        if run_id is not None and not valid_run_id(run_id):
            raise InvalidRequestError(
                f"runId {run_id!r} must be 1-64 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit",
                field="runId",
            )
        with self._state_lock:
            loaded = exp_id in self._experiments
        # Checked, and its task built (a tenant's dataset opened and checked), before the
        # model lock: a big file holds no tick (issue 26). Built under it only if the
        # experiment was removed in between.
        exp = None if loaded else self._build(exp_id, spec, namespace, name or exp_id, run_id)
        kept = False
        try:
            with self._model_lock:
                existing = self._experiments.get(exp_id)
                if existing is not None:
                    self.publisher.update(existing, spec, run_id)  # publish: in place, else 409
                    return existing.status(), False
                exp = exp or self._build(exp_id, spec, namespace, name or exp_id, run_id)
                self._load(exp, resume_from, run_id)
                self.publisher.attach(exp)
                try:
                    self.backend.add_adapter(exp_id)
                except Exception:
                    self.optimizer.remove_adapter(exp_id)
                    self.model.remove_adapter(exp_id)
                    raise
                if self.ranks is not None:
                    self.ranks.adapter_added(exp_id)
                with self._state_lock:
                    self._experiments[exp_id] = exp
                kept = True
                self.work_available.set()
                return exp.status(), True
        finally:
            if exp is not None and not kept:
                exp.task.close()  # its dataset's descriptors, its reward's client

    def checkpoint_task_experiment(self, exp_id: str) -> CheckpointRef:
        with self._model_lock:
            exp = self._require(exp_id)
            if exp.phase == "Failed":
                raise ConflictError(f"experiment {exp_id!r} failed; its last checkpoint stands")
            return self.store.save(exp)

    def remove_task_experiment(self, exp_id: str) -> ExperimentStatus:
        with self._model_lock:
            exp = self._require(exp_id)
            if exp.phase != "Failed" and (
                exp.checkpoint is None or exp.checkpoint.step != exp.step
            ):
                self.store.save(exp)
            self.scorer.forget(exp)
            self.backend.remove_adapter(exp_id)
            slot = self.model.slot_of(exp_id)
            self.optimizer.remove_adapter(exp_id)
            self.model.remove_adapter(exp_id)
            if self.ranks is not None:
                self.ranks.adapter_removed(exp_id, slot)
            with self._state_lock:
                del self._experiments[exp_id]
            return exp.status()

    def complete(self, job: PromptJob) -> list[ServedRow]:
        """Served by the next tick, inside its rollout batch; ``job.on_token`` sees each
        token as the decode makes it (torch backend; vLLM answers whole rows)."""
        served = self.client_experiments.served(job)  # a client experiment's model's adapter
        live = served is not job or job.model in (self.model_name, *self._experiments)
        version = None if live else self.publisher.serving(job.model)  # versions/names.py
        job = served
        self.limits.check_completion(len(job.prompt_ids), job.max_tokens, job.n)
        queued = CompletionJob.of(job, self.model_name, version)
        with self._jobs_lock:
            if self._refusing is not None:
                raise UnavailableError(self._refusing)
            self._jobs.append(queued)
            self.work_available.set()
        if not queued.done.wait(COMPLETION_TIMEOUT_S):
            with self._jobs_lock:
                if queued in self._jobs:
                    self._jobs.remove(queued)
            raise UnavailableError(f"no tick served this completion in {COMPLETION_TIMEOUT_S:.0f}s")
        return queued.answer()

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.codec.prompt_ids(prompt)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.codec.decode(token_ids)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return self.codec.chat_prompt_ids(messages)

    def tick(self) -> TickReport | None:
        """A training tick or a serving tick, as the time share picks (tick/time_share.py)."""
        self.clients.gather()  # client calls on their way join this tick (clients/gather.py)
        with self._model_lock:
            running = [e for e in self._experiments.values() if e.phase == "Running"]
            cheapest = min((e.step_cost for e in running if e.step_cost > 0), default=None)
            with self._jobs_lock:  # pick and take together: no wake-up is lost
                train = self._tick.has_work(running) or self.clients.has_work(cheapest)
                kind = self.time_share.pick(train=train, serve=bool(self._jobs))
                if kind is None:
                    self.work_available.clear()
                    return None
                jobs: list[CompletionJob] = []
                client = self.clients.take(kind == "train", cheapest)
                if kind == "serve":
                    jobs, self._jobs = take_in_turn(
                        self._jobs, CompletionJob.model_of, CompletionJob.cost, self.max_step_tokens
                    )
            try:
                if kind == "serve":
                    report = self._tick.serve(jobs)
                else:  # client models' calls are training work (clients/ticking.py)
                    passes = getattr(self.strategy, "passes", 0)
                    report = self._tick.run(running, client.start(), client.train)
                    report.train_passes = getattr(self.strategy, "passes", 0) - passes
            except BaseException as e:
                # A fault of the shared model or device: every job this tick took is
                # answered, none waits for a tick that already gave up on it.
                resolve(jobs, UnavailableError(f"the tick serving this failed: {type(e).__name__}"))
                client.fail(e)
                raise
            finally:
                client.finish()
            self.time_share.charge(kind, report.seconds)
            if report.adapter_sync is not None and self.adapter_sync is not None:
                with self._state_lock:  # capacity() reads it from request threads
                    self.adapter_sync.record(report.adapter_sync)
            return report

    def _build(
        self, exp_id: str, spec: ExperimentSpec, namespace: str, name: str, run_id: str | None
    ) -> Experiment:
        """Check the spec against the model, then build the experiment (its task reads
        the dataset); nothing is loaded yet. Needs no lock: it reads only what is fixed,
        and the free-slot check is done again when the adapter is added."""
        plan = compile_plan(spec, self.plan_limits)  # rank, targets, params, step cost
        assert plan.task is not None  # a client experiment is clients/experiments.py's
        check_chat_templates(plan.task, self.codec, self.model_name)  # prompts, observations
        if not self.model.has_room():  # a cached version gives its slot back when asked
            raise NoCapacityError(f"all {self.model.max_adapters} adapter slots are taken")
        timeout = self.settings.plugin_timeout
        return new_experiment(exp_id, plan, namespace, name, run_id, self.trust, timeout)

    def _load(self, exp: Experiment, resume_from: str | None, run_id: str | None) -> None:
        """Its adapter, fresh or resumed, into a slot (under the model lock); a failure
        changes nothing."""
        plan: ExperimentPlan = exp.plan
        config = plan.lora
        alone = not self._experiments
        try:
            if resume_from:
                self.store.resume_from(exp, config, Path(resume_from), run_id, alone)
            elif run_id is None or not self.store.resume_run(exp, config, alone):
                self.model.add_adapter(exp.id, config, seed=plan.seed)
                self.optimizer.add_adapter(exp.id, plan.optimizer)
        except NoFreeSlotError as e:
            raise NoCapacityError(str(e)) from e

    def _require(self, exp_id: str) -> Experiment:
        exp = self._experiments.get(exp_id)
        if exp is None:
            raise NotFoundError(f"no experiment {exp_id!r} on this engine")
        return exp
