"""Types the engine exposes to its drivers (HTTP server, local runner, benchmark).

The engine loop, the server and the runner agree on these, the protocol of spec/service.py
and nothing else, so the server stays a thin translation layer between HTTP and the
engine. The errors the engine raises live in :mod:`loraplex_engine.spec.errors` (``ApiError``
and subclasses).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, computed_field
from pydantic.alias_generators import to_camel

if TYPE_CHECKING:  # the HTTP layer reads this module without the spec's blocks
    from loraplex_engine.spec.eval_scores import EvalResult
    from loraplex_engine.spec.tracking import TrackingSpec

# The dtypes a frozen base may be loaded in (lora/precision.py maps them to torch's).
DTYPE_NAMES = ("bfloat16", "float16", "float32")
# How the multi-LoRA layers compute their delta (lora/grouped.py): grouped matmuls where
# the fused kernel runs (auto), always the bmm path, or always the grouped algorithm.
LORA_KERNELS = ("auto", "bmm", "grouped")

# Tokens one experiment's step may cost: groupSize x promptsPerStep x (the prompt limit +
# maxNewTokens), checked at admission. A step runs inside one tick, so its size bounds the
# longest wait a co-tenant can see (tick/fair_share.py paces big steps on average).
DEFAULT_MAX_STEP_TOKENS = 1 << 18
# Of the engine's time while both wait: completion requests' (tick/time_share.py).
DEFAULT_SERVING_SHARE = 0.25
DEFAULT_MAX_PROMPT_TOKENS = 1024  # longest prompt (task data) a rollout row may have
MAX_NEW_TOKENS = 4096  # largest spec.rollout.maxNewTokens
# Padded tokens of one training micro-batch (train/step.py; serve --micro-batch-tokens).
DEFAULT_MICRO_BATCH_TOKENS = 4096
# KV-cache tokens one micro-batch of the torch rollout may hold (rollout/packing.py; serve
# --rollout-kv-tokens): a fixed, conservative value (a 4B model's cache at 65536 tokens is
# ~9 GiB in bf16) that bounds the rollout's cache whatever the number of tenants.
DEFAULT_ROLLOUT_KV_TOKENS = 65536
# How long a tick waits for an experiment's reward before stepping without it (it trains in
# the tick after the reward arrives, tick/fair_share.py): under a GPU tick (seconds), over a
# healthy reward service's answer (milliseconds to a few hundred).
DEFAULT_REWARD_DEADLINE_S = 1.0
# A client call waits at most this long for others on their way (clients/gather.py).
DEFAULT_CLIENT_TICK_GATHER_S = 0.02
# A plug-in call's wall-clock bound (plugins/host.py; serve --plugin-timeout).
CALL_TIMEOUT_S = 30.0
# The largest max_tokens a completion request may ask (server/openai/; serve
# --max-completion-tokens).
DEFAULT_MAX_COMPLETION_TOKENS = 512
# A run id names the directory a run's checkpoints live in (<root>/<ns>/<name>/<runId>/):
# a safe path segment (no "/", never "." or ".."), short enough for any file system.
RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
RUN_ID_MAX_LENGTH = 64

# Runs of one experiment name (deleted and created again: a new run each time) whose
# checkpoints the run store keeps, the writing one included (serve --checkpoint-keep-runs).
DEFAULT_KEEP_RUNS = 3
# The memory plan (memory/capacity_plan.py): the share of the device's memory left unplanned
# (allocator rounding and fragmentation, kernel workspaces, the rollout's transient
# activations). Where no device memory is known the two budgets above apply.
DEFAULT_MEMORY_HEADROOM = 0.15

ExperimentPhase = Literal["Running", "Succeeded", "Failed"]
# The phases of a tick, in order (tick/tick.py): the keys of TickReport.phase_seconds.
TICK_PHASES = ("rollout", "reward", "train", "sync", "checkpoint")
# Why an experiment failed (status.failureReason, the metrics label): task_error (its task
# data or prompts), reward_error (its reward: an error, an invalid score or no answer),
# non_finite (it diverged), checkpoint_error (its checkpoint could not be written),
# rollout_error (the rollout backend refused or failed its requests or its adapter).
FAILURE_REASONS = ("non_finite", "reward_error", "task_error", "checkpoint_error", "rollout_error")
# Failures that follow from the spec and its data alone: placing the same spec again fails
# the same way, so a driver should not retry it elsewhere (status.deterministicFailure).
DETERMINISTIC_FAILURES = frozenset({"non_finite", "task_error"})


class WireModel(BaseModel):
    """Snake_case in Python, camelCase on the wire: one model is both the engine's value
    and the HTTP body (the server's response model), so the two cannot drift."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, mode="json")


class CheckpointRef(WireModel):
    path: str
    step: int


class VersionSummary(WireModel):
    """A published version (store/versions.py's manifest, in brief)."""

    version: str  # "v3"
    step: int
    scores: dict[str, float]
    gate_passed: bool | None  # the promotion gate's verdict (None: no gate)
    created_at: str
    content_hash: str
    eval_step: int | None = None  # the eval its eval scores are of
    gate_note: str | None = None  # why it failed its gate
    request_token: str | None = None  # the publish.requestToken it answered


class ExperimentStatus(WireModel):
    id: str
    namespace: str
    name: str
    phase: ExperimentPhase
    step: int
    max_steps: int
    reward: float | None
    rollout_tokens: int
    train_tokens: int
    checkpoint: CheckpointRef | None
    adapter_path: str | None
    error: str | None
    started_at: str
    updated_at: str
    run_id: str | None = None  # the run whose checkpoints this experiment writes
    failure_reason: str | None = None  # a FAILURE_REASONS entry when phase is Failed
    deterministic_failure: bool = False  # retrying the same spec would fail the same way
    # Mean |log p_sampler - log p_trainer| over the latest step's sampled tokens: how far
    # off-policy the rollout backend is (vLLM); None where the trainer samples itself.
    logprob_gap: float | None = None
    # Mean truncated-importance weight over the latest step's sampled tokens
    # (offPolicyCorrection: tis; every rank's under data parallelism); None without TIS.
    tis_weight_mean: float | None = None
    # Steps whose update algorithm.dynamicSampling skipped (every group's rewards equal),
    # since this engine placed the experiment (not carried in checkpoints).
    skipped_updates: int = 0
    # A due checkpoint found the volume full and waits for room (Capacity.storage_full),
    # retried every tick while training goes on.
    checkpoint_pending: bool = False
    # Published versions (newest last, the most recent few) and the aliases pointing at
    # them, alias -> "v<N>" (docs/versions.md); why the last publish or alias edit failed.
    versions: list[VersionSummary] = []
    aliases: dict[str, str] = {}
    publish_error: str | None = None
    publish: dict[str, Any] | None = None  # the spec.publish the engine applies (JSON)
    # The last publish.requestToken published (a version answered it).
    publish_request_token: str | None = None
    # spec.eval's latest result (evaluation/; docs/evaluation.md), None before the first:
    # the adapter after evalStep steps scored a mean reward of evalReward over the eval
    # set's completions, and a pass@k (k = evalK) of evalPassAtK. The promotion gate's
    # score. evalTokens: prompt + completion tokens of every eval so far on this engine.
    eval_step: int | None = None
    eval_reward: float | None = None
    eval_pass_at_k: float | None = None
    eval_k: int | None = None
    eval_tokens: int = 0
    # A client experiment's: seconds since its client's last call (0 while one is
    # queued; counted from placement), by which the operator enforces
    # spec.client.idleSeconds. None for a task experiment.
    idle_seconds: float | None = None


class MemoryUse(WireModel):
    rss_bytes: int
    device_bytes: int


class ModelShape(WireModel):
    """The base model's dimensions, as the operator's adapter memory estimate reads them
    (the EnginePool's `modelShape`): a pool that does not declare one learns it here."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    kv_dim: int  # output width of k_proj/v_proj (heads x head dim with grouped-query attention)


class MemoryPlan(WireModel):
    """How the engine sized itself (memory/capacity_plan.py): what placement counts per slot,
    and the budgets its training and rollout run under."""

    device_total_bytes: int | None  # the device's memory (CUDA), the host's RAM (CPU)
    device_bytes: int | None  # planned against: --device-memory, or CUDA's free + own
    headroom: float  # share of device_bytes left unplanned
    base_bytes: int  # the frozen base's parameters and buffers
    slot_bytes: int  # one adapter slot at max rank on every wrapped linear: fp32 weights,
    # their gradient and two Adam moments (every slot costs this, whatever its rank)
    slots: int  # slots allocated: maxAdapters + 1 (slot 0 is the base's)
    activation_fixed_bytes: int | None  # of a training micro-batch (None: not measured)
    activation_bytes_per_token: int | None
    activation_bytes_per_adapter: int | None  # per adapter with rows in the micro-batch
    kv_bytes_per_token: int | None  # K and V of one rollout token across the layers
    micro_batch_tokens: int  # the training micro-batch's padded-token budget
    rollout_kv_tokens: int | None  # the torch rollout's KV-cache token budget (None: vLLM's own)
    derived: list[str]  # which budgets the plan chose ("microBatchTokens", ...)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def static_bytes(self) -> int:
        return self.base_bytes + self.slot_bytes * self.slots


# How adapter weights reached the rollout backend in a tick (rollout/backends.py): in memory
# ("tensors"), or as PEFT directories ("files": where the vLLM worker takes no tensors, and
# for the adapters a restarted worker re-loads).
SYNC_TRANSPORTS = ("tensors", "files")


class AdapterSync(WireModel):
    """One tick's weight sync: the adapters trained in it, pushed to the sampler (vLLM)."""

    seconds: float  # wall time: export, transfer and vLLM's load of every adapter sent
    adapters: int  # adapters sent: those trained this tick (the others did not change)
    bytes: int  # tensor bytes sent
    transport: str  # SYNC_TRANSPORTS entry; "files" if any adapter went as a directory


class AdapterSyncStats(WireModel):
    """The engine's weight syncs since start (``Capacity.adapter_sync``)."""

    syncs: int = 0
    seconds_total: float = 0.0
    adapters_total: int = 0
    bytes_total: int = 0
    last: AdapterSync | None = None

    def record(self, sync: AdapterSync) -> None:
        self.syncs += 1
        self.seconds_total += sync.seconds
        self.adapters_total += sync.adapters
        self.bytes_total += sync.bytes
        self.last = sync


class PluginGrantReport(WireModel):
    """One grant of the allowlist: plug-ins some namespaces (None: every one) may name."""

    namespaces: list[str] | None = None
    rewards: list[str] = []
    environments: list[str] = []


class InstalledPlugins(WireModel):
    """Plug-ins installed in the engine's image (plugins/discovery.py): the names a spec's
    task.reward and task.environment.name may use beyond the built-ins."""

    rewards: list[str] = []
    environments: list[str] = []
    # The pool's allowlist (tenancy/plugin_access.py); None: every namespace may use all.
    allowed: list[PluginGrantReport] | None = None


class Capacity(WireModel):
    model: str
    rollout_backend: str
    max_adapters: int
    max_rank: int
    dtype: str  # the frozen base's (adapters and optimiser state are float32)
    gradient_checkpointing: bool
    used_slots: int
    experiments: list[str]
    memory: MemoryUse
    model_shape: ModelShape | None = None
    plan: MemoryPlan | None = None
    # Weight syncs to the rollout backend so far; None where it has no copy to sync (torch).
    adapter_sync: AdapterSyncStats | None = None
    # Why checkpoints wait for room (the volume was full, ENOSPC/EDQUOT) while any running
    # experiment's is pending; None once they are written.
    storage_full: str | None = None
    plugins: InstalledPlugins = InstalledPlugins()
    # The module names its adapters may target (what it wraps): which of them a client
    # experiment's module kinds train, for the pool's allowedTargetModules check.
    target_modules: list[str] | None = None
    # Published versions resident in free slots (versions/slot_cache.py: evicted when a
    # slot is needed, so free_slots counts theirs), and versions loaded into one so far.
    resident_versions: list[str] = []
    version_loads: int = 0
    # Adapter paging (docs/design/paging.md): adapters it registers at most (experiments
    # and client models; None: an engine before paging, its slots), those paged out to
    # host memory now (listed in ``experiments``, not counted in ``used_slots``) and the
    # bytes they take there, and the page-ins and page-outs so far.
    max_registered: int | None = None
    paged_adapters: int = 0
    spilled_adapters: int = 0  # of those, written to the checkpoint volume (third tier)
    paged_host_bytes: int = 0
    page_ins: int = 0
    page_outs: int = 0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def free_slots(self) -> int:
        return self.max_adapters - self.used_slots


@dataclass
class ExperimentTick:
    """What one experiment did in one tick (feeds metrics and progress output)."""

    id: str
    namespace: str
    step: int
    reward: float
    rollout_tokens: int
    train_tokens: int
    checkpointed: bool = False
    failed_reason: str | None = None  # set when this tick failed the experiment
    logprob_gap: float | None = None  # sampler vs trainer log-probs (ExperimentStatus)
    tis_weight_mean: float | None = None  # the TIS weight's mean (ExperimentStatus)
    tis_tokens: int = 0  # the sampled tokens TIS weighted (0: no TIS)
    dropped_groups: int = 0  # groups algorithm.dynamicSampling left out of the update
    update_skipped: bool = False  # every group dropped: the step updated nothing
    # The step's statistics the experiment trackers record (tracking/records.py):
    # train/step_stats.py's and the loss's (train/strategy.TrainOutcome); None: not known.
    reward_std: float | None = None
    response_tokens: float | None = None  # mean completion length
    entropy: float | None = None  # sampled-token estimate, -mean log p
    kl: float | None = None
    clip_fraction: float | None = None
    # Who the step was for, as the trackers name its run.
    name: str = ""
    run_id: str = ""
    tracking: TrackingSpec | None = None  # spec.tracking
    finished: bool = False  # its last tick: maxSteps reached and, with spec.eval, evaluated
    # spec.eval's result, in the tick that scored it (evaluation/; its step is the adapter's,
    # which may be before this tick's step). eval_only: the tick only evaluated the final
    # adapter (no step was taken: step, reward and tokens are the last step's, not new).
    eval: EvalResult | None = None
    eval_only: bool = False
    # The adapter's step whose weights sampled this step's rollout (step - 1 - it: how
    # stale; 0 on-policy, docs/design/pipeline.md).
    rollout_version: int = 0


@dataclass
class TickReport:
    seconds: float
    phase_seconds: dict[str, float]  # per TICK_PHASES entry
    experiments: list[ExperimentTick] = field(default_factory=list)
    adapter_sync: AdapterSync | None = None  # None: no adapter weights crossed this tick
    kind: str = "train"  # or "serve" (tick/time_share.py)
    # Forward/backward passes over the model this tick (the experiments' update, the
    # client models' calls): loraplex_engine_train_passes_total.
    train_passes: int = 0
