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
import time
from pathlib import Path

import psutil
import torch

from loraplex_engine.base_model import model_shape_of
from loraplex_engine.clients.experiments import ClientExperiments, ExperimentRoutes
from loraplex_engine.clients.models import ClientModels
from loraplex_engine.completion_jobs import CompletionJob, resolve
from loraplex_engine.engine_parts import build_parts, build_tick, client_parts
from loraplex_engine.environments.observations import check_chat_templates
from loraplex_engine.experiment import Experiment, new_experiment
from loraplex_engine.lora.precision import dtype_name
from loraplex_engine.memory.prefetch import prefetch
from loraplex_engine.parallel.distributed import World
from loraplex_engine.plan.experiment import ExperimentPlan, compile_plan
from loraplex_engine.plan.limits import EngineLimits
from loraplex_engine.plugins.discovery import installed
from loraplex_engine.settings.engine import EngineSettings
from loraplex_engine.spec.api_types import (
    Capacity,
    CheckpointRef,
    ExperimentStatus,
    MemoryUse,
    TickReport,
    VersionSummary,
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
from loraplex_engine.spec.publish import PublishSpec
from loraplex_engine.spec.service import PromptJob, ServedRow
from loraplex_engine.store.run_store import valid_run_id
from loraplex_engine.tenancy.admissions import KeyedLocks
from loraplex_engine.tenancy.trust import TrustPolicy
from loraplex_engine.tenancy.work_limits import WorkLimits
from loraplex_engine.tick.fair_share import RewardScorer
from loraplex_engine.tick.time_share import TimeShare, take_in_turn
from loraplex_engine.tick.working_set import WorkingSets
from loraplex_engine.versions.service import VersionRoutes

log = logging.getLogger("loraplex_engine.engine")

# How long a completion request waits for a tick to serve it: a tick that cannot (the loop
# stopped, the engine is shutting down) must not hold a request thread for ever.
COMPLETION_TIMEOUT_S = 300.0


class Engine:
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
        p = build_parts(  # the model, slots, trainer, rollout, store: engine_parts.py
            model_dir,
            s,
            device=device,
            world=world,
            model_name=model_name,
            ignore_eos=ignore_eos,
            share_prompt_prefix=share_prompt_prefix,
        )
        self.model_dir, self.model_name = p.model_dir, p.model_name
        self.device, self.dtype, self.tokenizer = p.device, p.dtype, p.tokenizer
        self.codec, self.model, self.lockstep = p.codec, p.model, p.lockstep
        self.default_targets, self.optimizer, self.store = p.default_targets, p.optimizer, p.store
        self.backend, self.strategy, self.ranks = p.backend, p.strategy, p.ranks
        self.publisher, self.adapter_sync = p.publisher, p.adapter_sync
        self.memory_plan, self.context_tokens = p.memory_plan, p.context_tokens
        self.pager = p.pager  # registered adapters beyond the slots (memory/paging.py)
        self.working_sets = WorkingSets(p.pager)  # each tick's, chosen first
        self.share_prompt_prefix = p.share_prompt_prefix
        self.rollout_backend, self.train_mode = s.rollout_backend, s.train_mode
        # Benchmarks: every rollout generates exactly maxNewTokens (equal token counts).
        self.ignore_eos = ignore_eos
        self.max_step_tokens, self.max_prompt_tokens = s.max_step_tokens, s.max_prompt_tokens
        # What tenants' data and rewards may reach (tenancy/trust.py; default: the strictest).
        self.trust = trust or TrustPolicy()
        self._experiments: dict[str, Experiment] = {}
        self._model_lock = threading.RLock()  # held for a whole tick and for mutations
        self._state_lock = threading.Lock()  # guards the dict for quick reads
        self._jobs: list[CompletionJob] = []
        self._jobs_lock = threading.Lock()
        self.work_available = threading.Event()  # set when a tick would have work
        self._settle_timer: threading.Timer | None = None  # _wake_when_the_share_settles
        self._refusing: str | None = None  # why completions are no longer served
        self.scorer = RewardScorer(s.reward_deadline, self._wake)
        self.time_share = TimeShare(s.serving_share)
        self.limits = WorkLimits(s.max_prompt_tokens, s.max_step_tokens, self.context_tokens)
        # What a spec is compiled against (plan/): every engine-side check of it.
        modules = frozenset(self.model.target_modules)
        self.plan_limits = EngineLimits(s.max_rank, modules, self.limits)
        self._tick = build_tick(p, s, world, self.scorer, self._wake)  # sync, or pipelined
        # Models a client trains itself (clients/), handed the parts they use by name.
        self.clients = ClientModels(
            client_parts(p, self.limits, self.plan_limits, self._model_lock, self._wake),
            s.client_models_per_tick,
            s.client_tick_gather,
            s.client_models_per_namespace,
        )
        self.client_experiments = ClientExperiments(
            self.clients, p.store.root, self.plan_limits
        )  # spec.client
        self.clients.adoptions = self.client_experiments.adoptable
        self.admissions = KeyedLocks()  # one PUT per experiment id at a time
        # The EngineService's experiment and version routes (below) delegate to these.
        self.experiments = ExperimentRoutes(self, self.client_experiments, self.admissions)
        self.versions = VersionRoutes(self.publisher, self._model_lock, self._resident)

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
        self.pager.close()

    def is_ready(self) -> bool:
        return True  # the constructor returns only once the model and backend are loaded

    # ---- the EngineService's experiments (task or client) and versions: delegated ------

    def put_experiment(
        self,
        exp_id: str,
        spec: ExperimentSpec,
        namespace: str = "default",
        name: str | None = None,
        resume_from: str | None = None,
        run_id: str | None = None,
    ) -> tuple[ExperimentStatus, bool]:
        return self.experiments.put_experiment(exp_id, spec, namespace, name, resume_from, run_id)

    def get_experiment(self, exp_id: str) -> ExperimentStatus:
        return self.experiments.get_experiment(exp_id)

    def list_experiments(self) -> list[ExperimentStatus]:
        return self.experiments.list_experiments()

    def checkpoint_experiment(self, exp_id: str) -> CheckpointRef:
        return self.experiments.checkpoint_experiment(exp_id)

    def remove_experiment(self, exp_id: str) -> ExperimentStatus:
        return self.experiments.remove_experiment(exp_id)

    def publish_version(self, exp_id: str) -> VersionSummary:
        return self.versions.publish_version(exp_id)

    def describe_version(self, model: str) -> VersionSummary:
        return self.versions.describe_version(model)

    def update_publish(self, exp_id: str, publish: PublishSpec | None) -> ExperimentStatus:
        return self.versions.update_publish(exp_id, publish)

    # ---- the engine's own experiments, those with a task --------------------------------

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
            used_slots=len(ids) - len(self.pager.pages),  # resident; the paged: below
            experiments=ids,
            memory=MemoryUse(rss_bytes=psutil.Process().memory_info().rss, device_bytes=device),
            model_shape=model_shape_of(self.model.base_model.config),
            target_modules=sorted(self.model.target_modules),
            plan=self.memory_plan,
            adapter_sync=sync,
            storage_full=storage_full,
            plugins=self.trust.plugins.listing(installed()),  # type: ignore[arg-type]
            **self.publisher.slot_stats(),
            **self.pager.capacity_fields(),
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
                    self.pager.discard(exp_id)  # its slot, or its fresh page
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
            return self.store.save(self._resident(exp_id))

    def remove_task_experiment(self, exp_id: str) -> ExperimentStatus:
        with self._model_lock:
            exp = self._resident(exp_id)
            if exp.phase != "Failed" and (
                exp.checkpoint is None or exp.checkpoint.step != exp.step
            ):
                self.store.save(exp)
            self.scorer.forget(exp)
            self.backend.remove_adapter(exp_id)
            slot = self.model.slot_of(exp_id)
            self.optimizer.remove_adapter(exp_id)
            self.model.remove_adapter(exp_id)
            self.pager.forget(exp_id)
            self.working_sets.forget(exp_id)
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

    def _wake_when_the_share_settles(self) -> None:
        """Held-back client calls may run once a recent co-tenant's window ends
        (tenancy/client_share.py): set ``work_available`` then, not an idle poll later."""
        at = self.clients.held_until()
        if at is None or (self._settle_timer is not None and self._settle_timer.is_alive()):
            return
        self._settle_timer = threading.Timer(max(0.0, at - time.monotonic()), self._wake)
        self._settle_timer.daemon = True
        self._settle_timer.start()

    def tick(self) -> TickReport | None:
        """A training tick or a serving tick, as the time share picks (tick/time_share.py)."""
        self.clients.gather()  # client calls on their way join this tick (clients/gather.py)
        with self._model_lock:
            running = [e for e in self._experiments.values() if e.phase == "Running"]
            waiting, samples = self.clients.demand()
            ws = self.working_sets.choose(running, self._tick.waits, waiting, samples)
            self.clients.room = ws.client_room
            cheapest = min((e.step_cost for e in running if e.step_cost > 0), default=None)
            with self._jobs_lock:  # pick and take together: no wake-up is lost
                train = self._tick.has_work(running) or self.clients.has_work(cheapest)
                kind = self.time_share.pick(train=train, serve=bool(self._jobs))
                if kind is None:
                    self.work_available.clear()
                    self._wake_when_the_share_settles()
                    return None
                jobs: list[CompletionJob] = []
                client = self.clients.take(kind == "train", cheapest)
                if kind == "serve":
                    jobs, self._jobs = take_in_turn(
                        self._jobs, CompletionJob.model_of, CompletionJob.cost, self.max_step_tokens
                    )
            try:
                if kind == "serve":
                    live = [j.slot_name for j in jobs if j.slot_name]
                    self.pager.ensure(live)
                    self.pager.ready(live)  # their page-ins' copies, right before the rows
                    report = self._tick.serve(jobs)
                else:  # client models' calls are training work (clients/ticking.py)
                    taken = [e.id for e in ws.experiments] + client.slot_names()
                    self.pager.ensure(taken, ws.pinned)  # page in before any row runs
                    if client.samples:  # a spare slot for a saved sampler's adapter
                        self.pager.make_room(self.pager.busy)
                    passes = getattr(self.strategy, "passes", 0)
                    self.pager.ready(taken)  # their copies, right before any row runs
                    report = self._tick.run(ws.experiments, client.start(), client.train)
                    # The next tick's likely members, copied while this tick's kernels run.
                    prefetch(self.pager, self.clients.waiting_names(), bool(client.samples))
                    report.train_passes = getattr(self.strategy, "passes", 0) - passes
            except BaseException as e:
                # A fault of the shared model or device: every job this tick took is
                # answered, none waits for a tick that already gave up on it.
                resolve(jobs, UnavailableError(f"the tick serving this failed: {type(e).__name__}"))
                client.fail(e)
                raise
            finally:
                client.finish()
                self.pager.release()
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
        # Prompts, observations: plan/admission.py, as `run` checks before its model loads.
        check_chat_templates(plan.task, self.codec, self.model_name)
        if not self.pager.has_room():  # a cached version gives its slot back when asked
            raise NoCapacityError(f"all {self.pager.max_registered} adapters are registered")
        timeout = self.settings.plugin_timeout
        return new_experiment(exp_id, plan, namespace, name, run_id, self.trust, timeout)

    def _load(self, exp: Experiment, resume_from: str | None, run_id: str | None) -> None:
        """Its adapter, fresh or resumed, into a slot (under the model lock); a failure
        changes nothing."""
        plan: ExperimentPlan = exp.plan
        config = plan.lora
        alone = not self._experiments
        if not self.pager.has_room():
            raise NoCapacityError(f"all {self.pager.max_registered} adapters are registered")
        self.pager.check_registration(exp.namespace)  # its spilled pages within its quota
        try:
            if resume_from or run_id is not None:  # state to read into a slot: room first
                self.pager.make_room()  # the least recently used adapter leaves its slot
            if resume_from:
                self.store.resume_from(exp, config, Path(resume_from), run_id, alone)
            elif run_id is None or not self.store.resume_run(exp, config, alone):
                # A free slot, else a fresh page its first tick pages in.
                self.pager.add(exp.id, config, plan.seed, plan.optimizer, None, exp.namespace)
                return
        except NoFreeSlotError as e:
            raise NoCapacityError(str(e)) from e
        self.pager.register(exp.id, namespace=exp.namespace)

    def _resident(self, exp_id: str) -> Experiment:
        """A loaded experiment whose adapter is in its slot (paged in if it was out);
        under the model lock."""
        exp = self._require(exp_id)
        with self._model_lock:
            self.pager.page_in(exp_id)
        return exp

    def _require(self, exp_id: str) -> Experiment:
        exp = self._experiments.get(exp_id)
        if exp is None:
            raise NotFoundError(f"no experiment {exp_id!r} on this engine")
        return exp
