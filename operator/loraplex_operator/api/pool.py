"""``EnginePool.spec``: a set of hot engine pods sharing one base model, one rollout
backend and one capacity per engine.

The one source of the pool's spec schema (``scripts/gen_crds.py``) and of its defaults:
the API server applies the CRD's, the operator reads a pool through ``EnginePoolSpec``
(``resources.Pool``), and both come from the fields below.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from loraplex_operator.api.object_store import ObjectStore
from loraplex_operator.api.plugins import PluginAccess
from loraplex_operator.api.pool_capacity import Capacity, ModelShape
from loraplex_operator.api.pool_names import SERVED_MODEL_NAMES, ServedName
from loraplex_operator.api.pool_template import EngineTemplate
from loraplex_operator.api.pool_tracking import PoolTracking
from loraplex_operator.api.priority import MAX_CLASSES, PriorityClass
from loraplex_operator.api.schema import (
    DNS_LABEL,
    LIST_SET,
    PRESERVE_UNKNOWN,
    ApiModel,
    Cel,
    Int32,
    Int64,
    Namespace,
    block,
    immutable,
    list_map,
)

AbsolutePath = Annotated[str, Field(min_length=2, max_length=4096, pattern=r"^/")]
# The projections of every supported family: Llama's seven, and Phi-3's fused ones.
FAMILY_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
)


class VLLMPlacement(ApiModel):
    """spec.vllm; None fields: the engine decides by its device (co-located, sleeping)."""

    device: str | None = Field(
        None,
        pattern=r"^cuda(:[0-9]+)?$",
        description="A GPU of the engine pod for vLLM alone (cuda:1; request two GPUs in the "
        "template). Absent: the trainer's GPU (co-located).",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        alias="gpuMemoryUtilization",
        ge=0.01,
        le=1,
        description="vLLM's share of its GPU's total memory (gpu_memory_utilization). "
        "Co-located, it must fit what the trainer left free (the engine refuses to start "
        "otherwise). Absent: half of the free memory co-located, 0.9 on its own GPU.",
    )
    sleep_mode: bool | None = Field(
        None,
        alias="sleepMode",
        description="vLLM sleep mode (level 1) around each training phase: weights to host "
        "memory and the KV cache dropped while the trainer trains. Absent: on co-located, off "
        "on its own GPU. Needs CUDA.",
    )


class Replicas(ApiModel):
    CEL_RULES: ClassVar = (
        Cel("self.min <= self.max", "replicas.min must be less than or equal to replicas.max"),
    )

    min: Int32 = Field(
        0, ge=0, le=1000, description="Engines kept running even when idle (0 = scale to zero)."
    )
    max: Int32 = Field(
        1, ge=1, le=1000, description="Most engines; more than 1 needs checkpoint.volume."
    )


class CheckpointStorage(ApiModel):
    root: AbsolutePath = Field(
        "/ckpt",
        description="Checkpoint root inside the engine pods (<root>/<namespace>/<name>/<run "
        "id>/step-NNNNNNNN; the run id is the LoRAExperiment uid).",
    )
    volume: dict[str, Any] | None = Field(
        None,
        description="core/v1 VolumeSource mounted at root (shared by all engines, e.g. a "
        "ReadWriteMany PVC). Absent = emptyDir.",
        json_schema_extra=PRESERVE_UNKNOWN,
    )
    quota_bytes_per_namespace: Int64 | None = Field(
        None,
        alias="quotaBytesPerNamespace",
        ge=1,
        description="Bytes each namespace's checkpoints may take on the volume (all its "
        "experiments and runs); a checkpoint that would pass it is refused before it is "
        "written, and that experiment fails alone. Passed as `serve "
        "--checkpoint-quota-bytes`. Absent = unbounded (one tenant may fill the volume).",
    )
    keep_runs: Int32 | None = Field(
        None,
        alias="keepRuns",
        ge=1,
        le=1000,
        description="Runs of one experiment name (deleted and created again: a new run, "
        "the new uid) whose checkpoints stay on the volume; when a run writes, the name's "
        "other runs past the newest keepRuns - 1 are removed, oldest first (never the "
        "writing run, nothing of another name). Passed as `serve --checkpoint-keep-runs`. "
        "Absent = the engine's default, 3.",
    )


class LabelSelectorRequirement(ApiModel):
    key: str = Field(description="The label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="How the label relates to values."
    )
    values: tuple[str, ...] | None = Field(
        None, description="Label values (In, NotIn); empty for Exists and DoesNotExist."
    )


class LabelSelector(ApiModel):
    match_labels: dict[str, str] | None = Field(
        None, alias="matchLabels", description="Labels a namespace must all carry."
    )
    match_expressions: tuple[LabelSelectorRequirement, ...] | None = Field(
        None,
        alias="matchExpressions",
        description="Label requirements a namespace must all meet.",
    )


class SecretKeyRef(ApiModel):
    name: str = Field(min_length=1, max_length=253, description="Name of the Secret.")
    key: str = Field(
        "token", min_length=1, max_length=253, description="The Secret key holding the token."
    )


def _names(alias: str, max_items: int, description: str) -> Any:
    """An optional set of strings (``x-kubernetes-list-type: set``)."""
    return Field(
        None,
        alias=alias,
        max_length=max_items,
        description=description,
        json_schema_extra=LIST_SET,
    )


ModuleName = Annotated[str, Field(min_length=1, max_length=63)]
Host = Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[-a-zA-Z0-9.:]+$")]


class EnginePoolSpec(ApiModel):
    """The engines' model, backend, capacity and pod template, how many engines to run,
    where checkpoints go, and which namespaces may use the pool."""

    CEL_RULES: ClassVar = (
        Cel(
            "!has(self.replicas) || !has(self.replicas.max) || self.replicas.max <= 1 || "
            "(has(self.checkpoint) && has(self.checkpoint.volume))",
            "a pool of more than one engine needs checkpoint.volume (shared storage) so "
            "experiments can resume on another engine",
        ),
        Cel(
            "!has(self.gpusPerEngine) || self.gpusPerEngine == 1 || "
            "!has(self.template.volumeMounts) || "
            "!self.template.volumeMounts.exists(m, m.mountPath == '/dev/shm')",
            "template.volumeMounts must not mount /dev/shm when gpusPerEngine is above 1: the "
            "operator mounts a memory-backed volume there (template.shmSize)",
        ),
        Cel(
            "!has(self.shardBase) || !self.shardBase || "
            "(has(self.gpusPerEngine) && self.gpusPerEngine >= 2)",
            "shardBase needs gpusPerEngine of 2 or more: the base is sharded over the engine's "
            "ranks, and one rank has nothing to shard it with",
        ),
    )

    base_model: AbsolutePath = Field(
        alias="baseModel",
        description="Absolute path of the Hugging Face base model directory inside the engine "
        "pod (baked into the image or on a template volume); passed to `loraplex-engine serve "
        "--model`.",
    )
    served_model_names: tuple[ServedName, ...] | None = SERVED_MODEL_NAMES
    rollout_backend: Literal["torch", "vllm"] = Field(
        "torch",
        alias="rolloutBackend",
        description="What generates the rollouts: torch (the engine's own batched sampler) or "
        "vllm (a vLLM worker process serving every adapter; the image must hold vLLM). "
        "Training is torch either way.",
    )
    dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        None,
        description="The dtype the engines load the frozen base in (`serve --dtype`): "
        "bfloat16, float16 or float32. LoRA weights and their Adam state are float32 whatever "
        "it is; log-probs and the loss are float32. Absent: each engine picks by its device "
        "(bfloat16 on a GPU, float32 on a CPU).",
    )
    vllm: VLLMPlacement = Field(
        default_factory=VLLMPlacement,
        description="Where the vLLM worker of each engine runs (rolloutBackend vllm, on a GPU; "
        "passed as `serve --vllm-option`). Absent: co-located on the trainer's GPU with half "
        "of the memory the trainer left and sleep mode around training.",
    )
    gpus_per_engine: Int32 = Field(
        1,
        alias="gpusPerEngine",
        ge=1,
        le=8,
        description="Ranks of each engine, one per GPU, in one pod (`serve --world-size`): "
        "data parallel, every rank holding every adapter slot, rank 0 serving the API. Above "
        "1 the operator passes --world-size, mounts a memory-backed /dev/shm "
        "(template.shmSize, for NCCL) and, on a GPU pool (template.resources asks for "
        "nvidia.com/gpu), raises the container's nvidia.com/gpu to at least this many; a CPU "
        "pool (no nvidia.com/gpu) runs this many gloo ranks on the container's CPUs and asks "
        "for no GPU. At most 8: the ranks share one pod, so one node (8 GPUs on the largest "
        "common GPU nodes). Capacity, maxAdapters and memoryBytes stay per rank. With "
        "rolloutBackend vllm, rank 0 runs the pod's one vLLM. Applies to engine pods created "
        "after a change.",
    )
    shard_base: bool = Field(
        False,
        alias="shardBase",
        description="Shard the frozen base model over the engine's ranks (`serve "
        "--shard-base`: FSDP2, each rank holding 1/gpusPerEngine of the decoder layers and "
        "gathering one layer at a time), for a base that does not fit one GPU. The LoRA "
        "adapter slots and the output head stay whole on every rank, so capacity, maxAdapters "
        "and memoryBytes stay per rank as with a replicated base. Costs an all-gather of "
        "every layer in each forward and backward, and turns prefix sharing off: leave it off "
        "when the base fits one GPU. Needs gpusPerEngine of 2 or more. Applies to engine pods "
        "created after a change.",
    )
    gradient_checkpointing: bool | None = Field(
        None,
        alias="gradientCheckpointing",
        description="Recompute each decoder layer in the backward instead of keeping its "
        "activations (`serve --gradient-checkpointing`): less memory, about one more forward "
        "per step. Absent: on for a GPU engine, off for a CPU one.",
    )
    engine_namespace: str = Field(
        "loraplex-system",
        alias="engineNamespace",
        min_length=1,
        max_length=63,
        pattern=DNS_LABEL,
        description="Namespace of the engine pods and of the token Secret. Immutable.",
        json_schema_extra=immutable("engineNamespace is immutable"),
    )
    capacity: Capacity = block(
        Capacity, "What one engine holds; placement never puts more on an engine."
    )
    model_shape: ModelShape | None = Field(
        None,
        alias="modelShape",
        description="Base model dimensions, for the adapter memory estimate (rank × (in + out) "
        "per layer and target module) of engines that report no memory plan on /v1/capacity "
        "(older images; a current engine reports its slot bytes, which win). Optional: "
        "absent, the operator uses the shape the engines report (modelShape), and estimates "
        "nothing until one has answered.",
    )
    allowed_target_modules: tuple[ModuleName, ...] = Field(
        FAMILY_TARGET_MODULES,
        alias="allowedTargetModules",
        max_length=64,
        description="LoRA target modules experiments may ask for (spec.lora.targetModules); "
        "one outside this list is not admitted. Default: the seven Llama projections and "
        "Phi-3's fused qkv_proj and gate_up_proj. An experiment without targetModules needs "
        "q_proj and v_proj, or qkv_proj, in this list (its base model family's default).",
        json_schema_extra=LIST_SET,
    )
    replicas: Replicas = block(
        Replicas,
        "How many engine pods the operator keeps: at least min, and up to max when admitted "
        "experiments wait for room; an idle engine above min is removed after a delay (60 s).",
    )
    template: EngineTemplate = Field(description=EngineTemplate.__doc__)
    checkpoint: CheckpointStorage = block(
        CheckpointStorage,
        "Where the engines write checkpoints (and find them again on a resume).",
    )
    data_roots: tuple[AbsolutePath, ...] | None = _names(
        "dataRoots",
        16,
        "Absolute directories inside the engine pods (mount them with template.volumes and "
        "template.volumeMounts) that jsonl datasets are read from, one subdirectory per "
        "namespace: task.dataset x.jsonl of namespace team-a is <root>/team-a/x.jsonl, and an "
        "absolute dataset must lie under <root>/<namespace>/ (symlinks resolved). Passed as "
        "`serve --data-root`. Absent or empty = jsonl experiments are refused.",
    )
    allow_dataset_hard_links: bool = Field(
        False,
        alias="allowDatasetHardLinks",
        description="Admit jsonl dataset files with more than one hard link (deduplicated "
        "or snapshot copies; `serve --allow-dataset-hard-links`). Off: refused, because a "
        "tenant able to hard-link another tenant's file into its own directory under "
        "dataRoots would read it; turn on only where tenants cannot make hard links there.",
    )
    object_store: ObjectStore | None = Field(
        None, alias="objectStore", description=ObjectStore.__doc__
    )
    reward_hosts: tuple[Host, ...] | None = _names(
        "rewardHosts",
        64,
        "rewardUrl hosts (exact names or addresses) allowed even where they resolve to a "
        "loopback, link-local or the engine pod's own address; passed as `serve "
        "--allow-reward-host`. Other hosts must resolve elsewhere; the engine's own port is "
        "never allowed.",
    )
    plugins: PluginAccess | None = Field(None, description=PluginAccess.__doc__)
    # None = not set; a pool with neither list nor selector admits every namespace.
    allowed_namespaces: tuple[Namespace, ...] | None = _names(
        "allowedNamespaces",
        1024,
        "Namespaces whose experiments may use this pool (with namespaceSelector, either one "
        "admits). Neither set = every namespace; an empty list admits none.",
    )
    namespace_selector: LabelSelector | None = Field(
        None,
        alias="namespaceSelector",
        description="metav1.LabelSelector over namespaces whose experiments may use this pool "
        "(see allowedNamespaces).",
    )
    priority_classes: tuple[PriorityClass, ...] | None = Field(
        None,
        alias="priorityClasses",
        max_length=MAX_CLASSES,
        description="The priorities experiments of this pool may name (spec.priorityClassName), "
        "each with its value, the namespaces that may use it and whether it preempts other "
        "namespaces' experiments. An experiment naming none has value 0 and preempts only "
        "lower values of its own namespace; one naming a class not listed here, or one its "
        "namespace may not use, is not placed. Names are unique (a map list keyed by name).",
        json_schema_extra=list_map("name"),
    )
    queue_name: str | None = Field(
        None,
        alias="queueName",
        min_length=1,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="Kueue LocalQueue (in engineNamespace) that meters the engine pods: each "
        "engine pod gets the label kueue.x-k8s.io/queue-name with this value, and Kueue's pod "
        "integration holds it behind a scheduling gate until its quota admits it. Until then "
        "the operator binds nothing to it and counts it as capacity asked for (condition "
        "CapacityPending, reason WaitingForAdmission). Absent = no queue. Applies to engine "
        "pods created after a change.",
    )
    tracking: PoolTracking | None = Field(None, description=PoolTracking.__doc__)
    token_secret_ref: SecretKeyRef = Field(
        alias="tokenSecretRef",
        description="Secret (in engineNamespace) holding the engine API bearer token; mounted "
        "into every engine pod and sent by the operator on each engine call.",
    )

    @classmethod
    def from_obj(cls, spec: Mapping[str, Any] | None) -> EnginePoolSpec:
        """A pool's ``spec`` as the API server stores it (defaults applied or not)."""
        return cls.model_validate(spec or {})


__all__ = [
    "FAMILY_TARGET_MODULES",
    "CheckpointStorage",
    "EnginePoolSpec",
    "LabelSelector",
    "LabelSelectorRequirement",
    "PriorityClass",
    "Replicas",
    "SecretKeyRef",
    "VLLMPlacement",
]
