"""The experiment spec: the ``LoRAExperiment`` custom resource's ``spec``, field for field.

The one source of the CRD's ``spec`` schema: ``scripts/gen_crds.py`` generates it from
these models (``make crds``), cross-field CEL rules included (``spec/schema.py``).
Unknown fields are rejected, so a typo never silently falls back to a default.
Kept free of torch and I/O: the HTTP layer and the local runner validate with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, ValidationError

from loraplex_engine.spec.algorithm import AlgorithmSpec
from loraplex_engine.spec.api_types import MAX_NEW_TOKENS
from loraplex_engine.spec.checkpoint import CheckpointSpec
from loraplex_engine.spec.client import CLIENT_RULES, ClientSpec, client_field
from loraplex_engine.spec.data_options import DatasetOptions
from loraplex_engine.spec.errors import SpecError
from loraplex_engine.spec.eval import EVAL_NEEDS_TASK, EvalSpec
from loraplex_engine.spec.params import TaskParams
from loraplex_engine.spec.plugins import EnvironmentSpec, PluginName
from loraplex_engine.spec.publish import (
    GATE_NEEDS_EVAL,
    ON_EVAL_NEEDS_EVAL,
    PUBLISH_FIELD,
    PublishSpec,
)
from loraplex_engine.spec.schema import (
    CelRule,
    FieldRule,
    Int32,
    ListSet,
    SpecModel,
    block,
    immutable,
    spec_errors,
)
from loraplex_engine.spec.tracking import TrackingSpec

TaskName = Literal["target-token", "copy", "arithmetic", "short-reply", "gsm8k", "jsonl", "dataset"]
DATA_TASKS = ("jsonl", "dataset")  # the tasks that read task.dataset
ModuleName = Annotated[
    str, Field(min_length=1, max_length=63, pattern=r"^[A-Za-z_][A-Za-z0-9_.]*$")
]
# A DNS subdomain, as Kubernetes names an object (the pool is one).
ObjectName = Annotated[
    str, Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
]
# A DNS label, as an EnginePool's spec.priorityClasses[].name (loraplex_operator/api/priority.py).
ClassName = Annotated[
    str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
]
# The retired raw priority: 0 (what the CRD used to default) is let through, nothing else.
RETIRED_PRIORITY = FieldRule(
    "self == 0",
    "spec.priority is no longer honoured: priorities are the pool's classes; remove "
    "spec.priority and name one in spec.priorityClassName (kubectl get enginepool -o yaml)",
    lambda value: value == 0,
)


class LoraSpec(SpecModel):
    """The adapter's shape."""

    CEL_RULES: ClassVar = (
        CelRule(
            "!has(self.alpha) || !has(self.rank) || self.alpha <= 16.0 * double(self.rank)",
            "lora.alpha must be at most 16 × lora.rank (scale alpha/rank ≤ 16)",
            "alpha",
            lambda lora: lora.alpha <= 16.0 * lora.rank,
        ),
    )

    rank: Int32 = Field(
        8,
        ge=1,
        le=256,
        description="LoRA rank r, the inner dimension of the adapter's A and B factors. "
        "Must not exceed the pool's capacity.maxRank (checked at admission).",
    )
    alpha: float = Field(
        16.0,
        gt=0,
        le=4096,
        description="LoRA scaling: the adapter's update is multiplied by alpha / rank. "
        "At most 16 × rank.",
    )
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout probability on the adapter's input while training; 0 = none.",
    )
    target_modules: (
        Annotated[list[ModuleName], Field(min_length=1, max_length=32), ListSet()] | None
    ) = Field(
        None,
        alias="targetModules",
        description="Linear layers of the base model that get the adapter, by the last "
        "component of their module name (q_proj matches model.layers.0.self_attn.q_proj). "
        "Each must be in the pool's allowedTargetModules and exist in the base model. "
        "Absent = the base model family's attention projections: q_proj and v_proj, or the "
        "fused qkv_proj where the family has one (Phi-3).",
    )


class TaskSpec(SpecModel):
    """What the adapter learns: where prompts come from and how completions are scored."""

    CEL_RULES: ClassVar = (
        CelRule(
            "!(self.name in ['jsonl', 'dataset']) || has(self.dataset)",
            "task.dataset is required when task.name is jsonl or dataset",
            "dataset",
            lambda task: task.name not in DATA_TASKS or task.dataset is not None,
        ),
        CelRule(
            "!has(self.dataset) || self.name in ['jsonl', 'dataset']",
            "task.dataset is only used by the jsonl and dataset tasks",
            "dataset",
            lambda task: task.dataset is None or task.name in DATA_TASKS,
        ),
        CelRule(
            "!has(self.datasetOptions) || self.name == 'dataset'",
            "task.datasetOptions is only used by the dataset task",
            "datasetOptions",
            lambda task: task.dataset_options is None or task.name == "dataset",
        ),
        CelRule(
            "!has(self.reward) || self.reward != 'http' || has(self.rewardUrl)",
            "task.rewardUrl is required when task.reward is http",
            "rewardUrl",
            lambda task: task.reward != "http" or task.reward_url is not None,
        ),
        CelRule(
            "!has(self.rewardUrl) || (has(self.reward) && self.reward == 'http')",
            "task.rewardUrl is only used when task.reward is http",
            "rewardUrl",
            lambda task: task.reward_url is None or task.reward == "http",
        ),
    )

    name: TaskName = Field(
        description="Where prompts come from: target-token, copy, arithmetic, short-reply and "
        "gsm8k (math word problems) generate them (with a built-in verifier); jsonl reads "
        "them from a JSONL dataset, "
        "dataset from a JSONL, Parquet or saved datasets one (datasetOptions).",
    )
    params: TaskParams = Field(
        default_factory=dict,
        description="The task's settings, as strings: target (target-token); length, "
        "alphabet (copy); maxOperand, partialCredit (arithmetic); maxWords (short-reply); "
        "minSteps, maxSteps, maxNumber, hint (gsm8k); jsonl takes none. "
        "The engine refuses unknown keys and bad values when the experiment is placed.",
    )
    dataset: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="Where the rows are: a path under the pool's dataRoots (relative: "
        "under <root>/<namespace>/), or an object-storage URL (s3://bucket/key, gs://) under "
        "the prefix the pool's objectStore gives the namespace. The jsonl task reads a JSONL "
        'file of {"prompt": str, "answer": str} objects; the dataset task any format '
        "datasetOptions names. Required by, and only used by, those two tasks.",
    )
    dataset_options: DatasetOptions | None = Field(
        None,
        alias="datasetOptions",
        description="The dataset task's format, split and columns (docs/datasets.md). "
        "Absent = format from the name, columns prompt and answer.",
    )
    reward: PluginName | None = Field(
        None,
        description="How a completion is scored: default (the task's own verifier), a "
        "built-in reward (exact-match, contains, prefix-overlap, word-fraction, coverage "
        "against the answer), http (scored by the service at rewardUrl), or the name of a "
        "reward plug-in installed in the engine (GET /v1/capacity lists them). "
        "Absent = the task's own verifier.",
    )
    environment: EnvironmentSpec | None = Field(
        None, description="A multi-turn environment the policy acts in (its reward scores)."
    )
    chat_template: bool = Field(
        False,
        alias="chatTemplate",
        description="Render each prompt as a user message through the base model's chat "
        "template (with the assistant turn opened) before encoding it, as instruct models "
        "expect. The engine refuses the spec when its tokenizer has no chat template.",
    )
    reward_url: str | None = Field(
        None,
        alias="rewardUrl",
        max_length=2048,
        pattern=r"^https?://[^\s]+$",
        description='URL the engine POSTs {"items": [{prompt, completion, answer}]} to, '
        'answered by {"scores": [float]}. Required when, and only used when, reward is http.',
    )


class RolloutSpec(SpecModel):
    """How completions are sampled from the policy being trained."""

    max_new_tokens: Int32 = Field(
        64,
        ge=1,
        le=MAX_NEW_TOKENS,
        alias="maxNewTokens",
        description="Most tokens generated per completion (fewer when the model ends it).",
    )
    temperature: float = Field(
        1.0,
        ge=0,
        le=2,
        description="Sampling temperature; 0 = greedy, which GRPO refuses (a group of "
        "identical completions has every advantage zero).",
    )
    reproducible: bool = Field(
        False,
        description="Seed every rollout request from algorithm.seed, so that the samples "
        "themselves repeat run after run on any device. vLLM then samples this "
        "experiment's requests each with its own generator, slower on GPU. Off, the vLLM "
        "backend on GPU samples unseeded: the prompt order and the adapter's initial "
        "weights still follow algorithm.seed, the sampled tokens do not. The torch backend "
        "and vLLM on CPU seed every request either way.",
    )


class ExperimentSpec(SpecModel):
    """What to train and how: the adapter (lora), the task and its reward, the RL
    algorithm, the rollouts, checkpointing, and scheduling (enginePool, priorityClassName,
    suspend). The operator forwards it to the engine unchanged (docs/engine-api.md)."""

    CEL_RULES: ClassVar = (
        CelRule(
            "!has(self.algorithm) || !has(self.rollout) || !has(self.algorithm.name) || "
            "self.algorithm.name != 'grpo' || !has(self.rollout.temperature) || "
            "self.rollout.temperature > 0.0",
            "GRPO needs rollout.temperature > 0: greedy rollouts make every completion of a "
            "group identical and every advantage zero",
            "rollout.temperature",
            lambda spec: spec.algorithm.name != "grpo" or spec.rollout.temperature > 0,
        ),
        CelRule(
            "!has(self.algorithm) || !has(self.algorithm.overlong) || !has(self.rollout) || "
            "!has(self.rollout.maxNewTokens) || "
            "self.algorithm.overlong.bufferTokens <= self.rollout.maxNewTokens",
            "algorithm.overlong.bufferTokens must be at most rollout.maxNewTokens (the "
            "punished zone lies inside the completion's length)",
            "algorithm.overlong.bufferTokens",
            lambda spec: (
                spec.algorithm.overlong is None
                or spec.algorithm.overlong.buffer_tokens <= spec.rollout.max_new_tokens
            ),
        ),
        *CLIENT_RULES,
        EVAL_NEEDS_TASK,
        GATE_NEEDS_EVAL,
        ON_EVAL_NEEDS_EVAL,
    )
    # Required by the CRD only: the operator needs a pool to place the experiment on,
    # while the engine and the local runner ignore the field.
    CLUSTER_REQUIRED: ClassVar[tuple[str, ...]] = ("enginePool",)

    engine_pool: ObjectName | None = Field(
        None,
        alias="enginePool",
        description="Name of the (cluster-scoped) EnginePool whose engines train this "
        "experiment. Required on a cluster; the engine ignores it. Immutable.",
        json_schema_extra=immutable(
            "spec.enginePool is immutable once created: create a new LoRAExperiment to run "
            "on another pool"
        ),
    )
    lora: LoraSpec = block(
        LoraSpec,
        "The adapter's shape. Immutable: the adapter's weights, optimiser state and "
        "checkpoints have this shape.",
        "spec.lora is immutable once created (the adapter's weights, optimiser state and "
        "checkpoints have its shape): create a new LoRAExperiment to change it",
    )
    task: TaskSpec | None = Field(
        None,
        description="Prompts and reward, i.e. what the adapter learns. Immutable. Required "
        "unless spec.client is set.",
        json_schema_extra=immutable(
            "spec.task is immutable once created (its prompts and reward define what the "
            "adapter learns): create a new LoRAExperiment to change it"
        ),
    )
    client: ClientSpec | None = client_field()
    algorithm: AlgorithmSpec = block(
        AlgorithmSpec,
        "The RL update and the run's length. Immutable: the engine takes it once, at "
        "placement, so an edit would silently split one run between two settings.",
        "spec.algorithm is immutable once created (one run trains with one algorithm setting "
        "and step budget): create a new LoRAExperiment to change it",
    )
    rollout: RolloutSpec = block(
        RolloutSpec,
        "How completions are sampled (the policy being trained). Immutable.",
        "spec.rollout is immutable once created (one run samples with one rollout setting): "
        "create a new LoRAExperiment to change it",
    )
    checkpoint: CheckpointSpec = block(
        CheckpointSpec,
        "How often checkpoints are written and how many are kept. Mutable: an edit takes "
        "effect the next time the experiment is placed on an engine (after suspend and "
        "resume, a preemption or a recovery); the running engine keeps the settings it was "
        "given.",
    )
    tracking: TrackingSpec = block(TrackingSpec, TrackingSpec.__doc__ or "")
    publish: PublishSpec | None = PUBLISH_FIELD
    evaluation: EvalSpec | None = Field(
        None,
        alias="eval",
        description="A fixed prompt set sampled with the adapter every eval.everySteps steps "
        "and scored with the task's reward (mean reward, pass@k) into status, metrics and "
        "trackers; never trained on. Absent = no eval. Mutable: the next placement takes it.",
    )
    priority_class_name: ClassName | None = Field(
        None,
        alias="priorityClassName",
        description="One of the pool's spec.priorityClasses that this namespace may use: its "
        "value orders the queue and what may be preempted. Absent = value 0. Mutable: the next "
        "round uses it. The engine ignores it.",
    )
    priority: Annotated[Int32, RETIRED_PRIORITY] | None = Field(
        None, description="Retired, not honoured: only 0 is accepted. Use priorityClassName."
    )
    suspend: bool = Field(
        False,
        description="true: checkpoint the experiment and unload it from its engine (freeing "
        "the slot); false again: resume from that checkpoint. Mutable. The engine ignores it.",
    )

    def to_json(self) -> dict[str, Any]:
        """camelCase dict, as the CRD and the HTTP API carry it."""
        return self.model_dump(by_alias=True, mode="json", exclude_none=True)


def parse_spec(data: Any, prefix: str = "spec") -> ExperimentSpec:
    """Validate a camelCase spec dict; raise ``SpecError`` naming the first bad field, its
    message followed by every other problem (one round trip shows them all)."""
    if not isinstance(data, Mapping):
        raise SpecError(prefix, f"must be a mapping, got {type(data).__name__}")
    try:
        return ExperimentSpec.model_validate(data)
    except ValidationError as exc:
        first, *rest = spec_errors(exc, prefix)
        also = "".join(f"; also {e.field}: {e.message}" for e in rest)
        raise SpecError(first.field, first.message + also) from None


def all_spec_errors(data: Any, prefix: str = "spec") -> list[SpecError]:
    """Every problem at once (for messages that list them all)."""
    try:
        ExperimentSpec.model_validate(data)
    except ValidationError as exc:
        return spec_errors(exc, prefix)
    return []
