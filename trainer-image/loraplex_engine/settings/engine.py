"""What an :class:`~loraplex_engine.engine.Engine` is configured with, as one typed object.

``EngineSettings`` is the engine's own (``Engine(model_dir, settings, ...)`` takes it
whole); ``ProcessSettings`` adds what a process running one needs around it (the model,
the device asked for, the data-parallel ranks). The commands' settings
(settings/commands.py) extend these; each field's ``Flag`` is its command-line face.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from loraplex_engine.settings import values as v
from loraplex_engine.settings.values import Flag
from loraplex_engine.spec.api_types import (
    CALL_TIMEOUT_S,
    DEFAULT_CLIENT_TICK_GATHER_S,
    DEFAULT_KEEP_RUNS,
    DEFAULT_MAX_PROMPT_TOKENS,
    DEFAULT_MAX_STEP_TOKENS,
    DEFAULT_MEMORY_HEADROOM,
    DEFAULT_MICRO_BATCH_TOKENS,
    DEFAULT_REWARD_DEADLINE_S,
    DEFAULT_ROLLOUT_KV_TOKENS,
    DEFAULT_SERVING_SHARE,
    DTYPE_NAMES,
    LORA_KERNELS,
)
from loraplex_engine.spec.errors import UsageError

ROLLOUT_BACKENDS = ("torch", "vllm")
TRAIN_MODES = ("fused", "timesliced")
SCHEDULES = ("sync", "pipelined")
# How long a collective waits for every rank (parallel/distributed.py, which imports torch):
# a worker waits for rank 0's next tick through a whole rollout and reward phase.
DEFAULT_DIST_TIMEOUT_S = 600.0


def check_train_mode(world_size: int, train_mode: str) -> None:
    """Data parallelism splits the fused update; the time-sliced baseline is one rank's."""
    if world_size > 1 and train_mode != "fused":
        raise UsageError(f"--world-size {world_size} needs --train-mode fused, not {train_mode}")


class EngineSettings(BaseModel):
    """The engine's configuration: its slots, budgets, precision and rollout."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    GROUP: ClassVar[str] = "engine"

    max_adapters: Annotated[int, Flag("adapter slots", v.to_int)] = 8
    max_rank: Annotated[int, Flag("largest LoRA rank", v.to_int)] = 64
    max_registered: Annotated[
        int | None,
        Flag(
            "adapters (experiments and client models) the engine holds at once: "
            "--max-adapters of them resident in slots, the rest paged out to host memory "
            "and paged in by the tick that needs them (docs/design/paging.md)",
            v.positive_int,
            metavar="N",
            default_text="64 x --max-adapters with one rank, the torch rollout and the "
            "sync schedule; else --max-adapters (no paging)",
        ),
    ] = None
    host_adapter_memory: Annotated[
        int | None,
        Flag(
            "host memory the paged-out adapters may take, e.g. 8GiB; past it the ones "
            "paged out longest ago are written to the checkpoint volume (a third tier) "
            "and read back when a tick needs them",
            v.bytes_or_none,
            default_text="none: unbounded",
        ),
    ] = None
    checkpoint_root: Annotated[
        str, Flag("checkpoints go to <root>/<namespace>/<name>/<run id>/step-<n>/")
    ] = "/ckpt"
    checkpoint_quota_bytes: Annotated[
        int | None,
        Flag(
            "what each namespace's checkpoints may take under the checkpoint root (all its "
            "experiments and runs), e.g. 50GiB; a checkpoint past it fails its experiment "
            "alone, before it is written",
            v.bytes_or_none,
            default_text="none: unbounded",
        ),
    ] = None
    checkpoint_keep_runs: Annotated[
        int,
        Flag(
            "runs of one experiment (namespace and name: deleted and created again, each "
            "time a new run) whose checkpoints are kept; when a run writes, the others past "
            "the newest N-1 are removed, oldest first",
            v.positive_int,
            metavar="N",
        ),
    ] = DEFAULT_KEEP_RUNS
    rollout_backend: Annotated[
        Literal["torch", "vllm"],
        Flag(
            "who samples the rollouts: torch (the trainer's own model) or vllm (a vLLM "
            "worker run with $LORAPLEX_VLLM_PYTHON; the trainer recomputes the old log-probs)",
            v.one_of("rollout backend", ROLLOUT_BACKENDS),
            metavar="{torch,vllm}",
        ),
    ] = "torch"
    train_mode: Annotated[
        Literal["fused", "timesliced"],
        Flag(
            "fused: one forward/backward for all adapters; timesliced: one at a time "
            "(the benchmark's baseline)",
            v.one_of("train mode", TRAIN_MODES),
            metavar="{fused,timesliced}",
        ),
    ] = "fused"
    schedule: Annotated[
        Literal["sync", "pipelined"],
        Flag(
            "sync: each tick rolls out, scores and trains every due experiment in turn; "
            "pipelined: one cohort trains while the others' rollouts generate (vLLM in its "
            "own process), each experiment on-policy unless its algorithm.maxStaleness > 0 "
            "(docs/design/pipeline.md)",
            v.one_of("schedule", SCHEDULES),
            metavar="{sync,pipelined}",
        ),
    ] = "sync"
    dtype: Annotated[
        str | None,
        Flag(
            f"the frozen base's dtype, one of {', '.join(DTYPE_NAMES)}; adapters and "
            "optimiser state are float32 whatever it is",
            v.dtype,
            default_text="bfloat16 on cuda, float32 on cpu",
        ),
    ] = None
    gradient_checkpointing: Annotated[
        bool | None,
        Flag(
            "recompute each decoder layer in the backward instead of keeping its activations",
            v.boolean,
            action="toggle",
            default_text="on for cuda, off for cpu",
        ),
    ] = None
    lora_kernel: Annotated[
        str,
        Flag(
            "the multi-LoRA delta: auto (grouped matmuls at each adapter's own rank where "
            "torch's fused kernel runs: CUDA, bf16, sm90/sm100; else bmm), bmm, or grouped "
            "(also where only its slower reference loop runs)",
            v.lora_kernel,
        ),
    ] = "auto"
    micro_batch_tokens: Annotated[
        int | None,
        Flag(
            "padded tokens of one training micro-batch (gradient accumulation over them)",
            v.tokens_or_auto,
            metavar="N",
            default_text=f"auto: the memory plan's, else {DEFAULT_MICRO_BATCH_TOKENS}",
        ),
    ] = None
    rollout_kv_tokens: Annotated[
        int | None,
        Flag(
            "KV-cache tokens of one torch rollout micro-batch (rows x (longest prompt + "
            "largest maxNewTokens)); the rollout decodes micro-batches one after another, "
            "so its cache stays under N tokens whatever the tenants",
            v.tokens_or_auto,
            metavar="N",
            default_text=f"auto: the memory plan's, else {DEFAULT_ROLLOUT_KV_TOKENS}",
        ),
    ] = None
    device_memory: Annotated[
        int | None,
        Flag(
            "memory the engine plans against, e.g. 80GiB",
            v.bytes_or_auto,
            default_text="auto: on cuda what is free plus what the engine holds; on cpu "
            "none, so nothing is derived",
        ),
    ] = None
    memory_headroom: Annotated[
        float,
        Flag(
            "share of --device-memory the plan leaves unused (fragmentation, workspaces)",
            v.fraction,
        ),
    ] = DEFAULT_MEMORY_HEADROOM
    max_step_tokens: Annotated[
        int,
        Flag(
            "largest groupSize x promptsPerStep x (--max-prompt-tokens + maxNewTokens) one "
            "experiment's step may cost, checked at PUT (one tenant must not stall the others)",
            v.to_int,
        ),
    ] = DEFAULT_MAX_STEP_TOKENS
    max_prompt_tokens: Annotated[
        int,
        Flag("longest prompt a rollout row may have; a longer one fails its experiment", v.to_int),
    ] = DEFAULT_MAX_PROMPT_TOKENS
    reward_deadline: Annotated[
        float,
        Flag(
            "how long a tick waits for an experiment's reward; a later one trains that "
            "experiment in the tick after it arrives, without holding the others",
            v.seconds,
            metavar="SECONDS",
        ),
    ] = DEFAULT_REWARD_DEADLINE_S
    plugin_timeout: Annotated[
        float,
        Flag(
            "wall-clock bound on each call of an installed plug-in (a reward, an "
            "environment's turn); one that takes longer is stopped and fails its experiment",
            v.seconds,
            metavar="SECONDS",
        ),
    ] = CALL_TIMEOUT_S
    serving_share: Annotated[
        float,
        Flag(
            "share of the engine's time for completion requests while training also waits "
            "(training gets the rest; either alone gets all of it)",
            v.share,
            metavar="FRACTION",
        ),
    ] = DEFAULT_SERVING_SHARE
    client_models_per_tick: Annotated[
        int | None,
        Flag(
            "client models (the Tinker protocol's) one tick takes a call segment of, in "
            "turn; 1 runs them one model at a time (SkyRL's per_model execution, the "
            "baseline of bench/tinker_clock.py) instead of fusing their forward/backward",
            v.count_or_all,
            metavar="N",
            default_text="all: every model with a call waiting",
        ),
    ] = None
    client_models_per_namespace: Annotated[
        int | None,
        Flag(
            "client models (the Tinker protocol's and client experiments') one namespace "
            "may hold on this engine; one more is refused naming this limit, so one tenant "
            "cannot take the slots of the others",
            v.positive_int,
            metavar="N",
            default_text="half the adapters it registers (--max-registered), rounded up",
        ),
    ] = None
    client_tick_gather: Annotated[
        float,
        Flag(
            "how long a client model's call (the Tinker protocol's) may wait, from its "
            "arrival, for the calls on their way to join its tick: an optim_step sent "
            "after its forward_backward, the next step of a client the last tick served "
            "(Tinker's clock cycle); 0 starts each tick on the calls already there",
            v.seconds,
            metavar="SECONDS",
        ),
    ] = DEFAULT_CLIENT_TICK_GATHER_S
    vllm_options: Annotated[
        dict[str, Any],
        Flag(
            "option for the vllm rollout backend (value parsed as JSON if it parses), e.g. "
            "max_model_len=4096 gpu_memory_utilization=0.5; repeatable, over "
            "LORAPLEX_VLLM_OPTIONS (a JSON object of them)",
            v.key_value,
            action="merge",
            metavar="KEY=VALUE",
            flag="--vllm-option",
            env="LORAPLEX_VLLM_OPTIONS",
            env_help="a JSON object of --vllm-option settings",
            default_text="none",
        ),
    ] = Field(default_factory=dict)
    shard_base: Annotated[
        bool,
        Flag(
            "shard the frozen base model over the --world-size ranks (FSDP2; the LoRA "
            "adapters stay replicated) for a base that does not fit one device",
            action="switch",
        ),
    ] = False

    @field_validator("lora_kernel")
    @classmethod
    def _known_kernel(cls, value: str) -> str:
        if value not in LORA_KERNELS:
            raise ValueError(f"lora_kernel must be one of {list(LORA_KERNELS)}, got {value!r}")
        return value

    @field_validator(
        "micro_batch_tokens",
        "rollout_kv_tokens",
        "checkpoint_keep_runs",
        "client_models_per_tick",
        "client_models_per_namespace",
        "max_registered",
    )
    @classmethod
    def _positive_budget(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"{info.field_name} must be at least 1, got {value}")
        return value


class ProcessSettings(EngineSettings):
    """A process that runs an engine: the model, the device asked for, its ranks."""

    GROUP: ClassVar[str] = "process"

    model: Annotated[
        str | None, Flag("base model directory (local)", default_text="none; required")
    ] = None
    device: Annotated[
        str,
        Flag(
            f"torch device: {v.DEVICES} (auto: cuda where torch sees a GPU, else cpu). "
            "With --world-size N, cuda puts rank r on cuda:<LOCAL_RANK> and the ranks talk "
            "over NCCL; on cpu over gloo",
            v.device,
            metavar="DEVICE",
        ),
    ] = "auto"
    world_size: Annotated[
        int,
        Flag(
            "data-parallel ranks of this engine (one per GPU; gloo on the CPU). This "
            "process is rank 0 and starts ranks 1..N-1 itself as this command, unless "
            "RANK is set (torchrun): then each process joins by env://",
            v.positive_int,
            metavar="N",
        ),
    ] = 1
    dist_timeout: Annotated[
        float,
        Flag(
            "how long a rank waits for the others in a collective (a worker waits a whole "
            "tick for the next train phase) before the engine fails",
            v.seconds,
            metavar="SECONDS",
        ),
    ] = DEFAULT_DIST_TIMEOUT_S
    log_format: Annotated[
        str,
        Flag(
            f"one of {', '.join(v.LOG_FORMATS)}: json writes one JSON object per line "
            "(time, level, logger, message, exception)",
            v.log_format,
        ),
    ] = "text"

    def check(self) -> None:
        """What these settings cannot run, refused before anything starts."""
        for flag, value in (("--max-adapters", self.max_adapters), ("--max-rank", self.max_rank)):
            if value < 1:
                raise UsageError(f"{flag} must be at least 1, got {value}")
        if self.shard_base and self.world_size < 2:
            raise UsageError("--shard-base needs --world-size above 1 (the ranks to shard over)")
        check_train_mode(self.world_size, self.train_mode)

    def engine(self) -> EngineSettings:
        """The engine's own settings, without the process's."""
        return EngineSettings(**{k: getattr(self, k) for k in EngineSettings.model_fields})
