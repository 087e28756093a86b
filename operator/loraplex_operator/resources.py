"""The operator's API group and typed, read-only views of its two resources.

`Experiment.from_obj` and `Pool.from_obj` read a raw object (from kopf or the API
server) once; the rest of the operator reads fields, not `.get("…", default)` chains.
The defaults here are the CRDs' (tests/operator/test_resources.py checks each one
against crds/*.yaml): the API server applies them, so they matter only for objects
built by hand, but then they must agree. The operator has no pydantic dependency, so
these are plain frozen dataclasses; a view keeps its raw object (`raw`) for what is
passed on untouched: the spec the engine is given and the object Events refer to.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from loraplex_operator.placement import ModelShape

GROUP = "loraplex.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
EXPERIMENT_KIND = "LoRAExperiment"
POOL_KIND = "EnginePool"
EXPERIMENT_PLURAL = "loraexperiments"
POOL_PLURAL = "enginepools"
FINALIZER = f"{GROUP}/finalizer"

# A hand-built object may lack metadata.namespace; the API server always sets it.
DEFAULT_NAMESPACE = "default"
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
# An experiment without targetModules gets the base model family's default, resolved by
# the engine (loraplex_engine.base_model.default_lora_targets): one of these sets.
DEFAULT_TARGET_CANDIDATES = (("q_proj", "v_proj"), ("qkv_proj",))


def parse_time(value: str | None) -> float | None:
    """RFC 3339 (as the API server writes it) to epoch seconds; None if absent or bad."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _dict(obj: Mapping[str, Any] | None, key: str) -> Mapping[str, Any]:
    """A sub-object; a missing or null one reads as empty (so its fields take defaults)."""
    value = (obj or {}).get(key)
    return value if isinstance(value, Mapping) else {}


def _strings(value: Any) -> tuple[str, ...] | None:
    """A list of names; None when absent (an empty list is a value: it allows nothing)."""
    return None if value is None else tuple(str(v) for v in value)


def _strings_or(value: Any, default: tuple[str, ...]) -> tuple[str, ...]:
    names = _strings(value)
    return default if names is None else names


@dataclass(frozen=True)
class Meta:
    name: str
    namespace: str = DEFAULT_NAMESPACE
    uid: str | None = None
    generation: int = 0
    created: float | None = None  # creationTimestamp, epoch seconds
    deleting: bool = False  # deletionTimestamp set

    @classmethod
    def from_obj(cls, obj: Mapping[str, Any]) -> Meta:
        meta = _dict(obj, "metadata")
        uid = meta.get("uid")
        return cls(
            name=str(meta.get("name", "")),
            namespace=str(meta.get("namespace") or DEFAULT_NAMESPACE),
            uid=uid if isinstance(uid, str) and uid else None,
            generation=int(meta.get("generation", 0)),
            created=parse_time(meta.get("creationTimestamp")),
            deleting=bool(meta.get("deletionTimestamp")),
        )


# --- LoRAExperiment --------------------------------------------------------------------


@dataclass(frozen=True)
class Lora:
    rank: int = 8
    target_modules: tuple[str, ...] | None = None  # None: the family default (engine's)


@dataclass(frozen=True)
class Algorithm:
    max_steps: int = 50  # 0 = continual: train until suspended or deleted


@dataclass(frozen=True)
class ExperimentSpec:
    engine_pool: str = ""
    priority: int = 0
    suspend: bool = False
    lora: Lora = field(default_factory=Lora)
    algorithm: Algorithm = field(default_factory=Algorithm)

    @classmethod
    def from_obj(cls, spec: Mapping[str, Any]) -> ExperimentSpec:
        lora, algorithm = _dict(spec, "lora"), _dict(spec, "algorithm")
        return cls(
            engine_pool=str(spec.get("enginePool", cls.engine_pool)),
            priority=int(spec.get("priority", cls.priority)),
            suspend=bool(spec.get("suspend", cls.suspend)),
            lora=Lora(
                rank=int(lora.get("rank", Lora.rank)),
                target_modules=_strings(lora.get("targetModules")),
            ),
            algorithm=Algorithm(max_steps=int(algorithm.get("maxSteps", Algorithm.max_steps))),
        )


@dataclass(frozen=True)
class CheckpointRef:
    path: str | None = None
    step: int | None = None


@dataclass(frozen=True)
class ExperimentStatus:
    """What the operator wrote last (its memory, not the truth: engines are)."""

    phase: str | None = None
    engine: str | None = None
    node: str | None = None
    restarts: int = 0
    checkpoint: CheckpointRef = field(default_factory=CheckpointRef)
    conditions: tuple[Mapping[str, Any], ...] = ()

    @classmethod
    def from_obj(cls, status: Mapping[str, Any]) -> ExperimentStatus:
        ckpt = _dict(status, "checkpoint")
        step = ckpt.get("step")
        return cls(
            phase=status.get("phase"),
            engine=status.get("engine"),
            node=status.get("node"),
            restarts=int(status.get("restarts") or 0),
            checkpoint=CheckpointRef(ckpt.get("path"), None if step is None else int(step)),
            conditions=tuple(status.get("conditions") or ()),
        )


@dataclass(frozen=True)
class Experiment:
    meta: Meta
    spec: ExperimentSpec
    status: ExperimentStatus
    raw: Mapping[str, Any] = field(compare=False, repr=False)

    @classmethod
    def from_obj(cls, obj: Mapping[str, Any]) -> Experiment:
        return cls(
            meta=Meta.from_obj(obj),
            spec=ExperimentSpec.from_obj(_dict(obj, "spec")),
            status=ExperimentStatus.from_obj(_dict(obj, "status")),
            raw=obj,
        )

    @property
    def key(self) -> str:
        """`<namespace>/<name>`: how the operator names it in logs and plans."""
        return f"{self.meta.namespace}/{self.meta.name}"

    @property
    def id(self) -> str:
        """The engine's id of it: `<namespace>.<name>` (a namespace holds no dot)."""
        return f"{self.meta.namespace}.{self.meta.name}"

    @property
    def raw_spec(self) -> Mapping[str, Any]:
        return _dict(self.raw, "spec")

    @property
    def raw_status(self) -> Mapping[str, Any]:
        return _dict(self.raw, "status")


# --- EnginePool ------------------------------------------------------------------------


@dataclass(frozen=True)
class Capacity:
    max_adapters: int = 8
    max_rank: int = 64
    memory_bytes: int = 0  # per engine, per rank of a multi-rank one; 0 = not enforced
    micro_batch_tokens: int | None = None  # None: each engine derives it (its memory plan)
    rollout_kv_tokens: int | None = None  # None: likewise (torch rollout's KV budget)
    device_memory_bytes: int | None = None  # None: the engine measures its device (CUDA)


@dataclass(frozen=True)
class Replicas:
    min: int = 0
    max: int = 1


@dataclass(frozen=True)
class SecretRef:
    name: str = ""
    key: str = "token"


@dataclass(frozen=True)
class VLLMPlacement:
    """spec.vllm; None fields: the engine decides by its device (co-located, sleeping)."""

    device: str | None = None
    gpu_memory_utilization: float | None = None
    sleep_mode: bool | None = None

    @classmethod
    def from_obj(cls, obj: Mapping[str, Any]) -> VLLMPlacement:
        share, sleep = obj.get("gpuMemoryUtilization"), obj.get("sleepMode")
        return cls(
            device=obj.get("device") or None,
            gpu_memory_utilization=None if share is None else float(share),
            sleep_mode=None if sleep is None else bool(sleep),
        )


@dataclass(frozen=True)
class PoolSpec:
    base_model: str = ""
    rollout_backend: str = "torch"
    engine_namespace: str = "loraplex-system"
    capacity: Capacity = field(default_factory=Capacity)
    replicas: Replicas = field(default_factory=Replicas)
    checkpoint_root: str = "/ckpt"
    token_secret: SecretRef = field(default_factory=SecretRef)
    model_shape: ModelShape | None = None
    allowed_target_modules: tuple[str, ...] = FAMILY_TARGET_MODULES
    # None = not set; a pool with neither list nor selector admits every namespace.
    allowed_namespaces: tuple[str, ...] | None = None
    namespace_selector: Mapping[str, Any] | None = None
    # None = not set: each engine picks by its device (bf16 + checkpointing on CUDA).
    dtype: str | None = None
    gradient_checkpointing: bool | None = None
    vllm: VLLMPlacement = field(default_factory=VLLMPlacement)
    queue_name: str | None = None  # Kueue LocalQueue (in engine_namespace) of the engine pods
    data_roots: tuple[str, ...] = ()  # where tenants' jsonl datasets may live (serve --data-root)
    reward_hosts: tuple[str, ...] = ()  # reward hosts allowed past the egress check
    # Ranks per engine (`serve --world-size`), one GPU each on a GPU pool; every rank holds
    # every slot, so capacity and memory stay per rank.
    gpus_per_engine: int = 1
    # The frozen base sharded over those ranks (`serve --shard-base`, FSDP2); the adapter
    # slots stay whole on every rank, so capacity stays per rank as above.
    shard_base: bool = False
    shm_size: str = "1Gi"  # template.shmSize: the /dev/shm of a multi-rank engine (NCCL)

    @classmethod
    def from_obj(cls, spec: Mapping[str, Any]) -> PoolSpec:
        capacity, replicas = _dict(spec, "capacity"), _dict(spec, "replicas")
        secret = _dict(spec, "tokenSecretRef")
        return cls(
            base_model=str(spec.get("baseModel", cls.base_model)),
            rollout_backend=str(spec.get("rolloutBackend", cls.rollout_backend)),
            engine_namespace=str(spec.get("engineNamespace", cls.engine_namespace)),
            capacity=Capacity(
                max_adapters=int(capacity.get("maxAdapters", Capacity.max_adapters)),
                max_rank=int(capacity.get("maxRank", Capacity.max_rank)),
                memory_bytes=int(capacity.get("memoryBytes", Capacity.memory_bytes)),
                micro_batch_tokens=_int_or_none(capacity.get("microBatchTokens")),
                rollout_kv_tokens=_int_or_none(capacity.get("rolloutKvTokens")),
                device_memory_bytes=_int_or_none(capacity.get("deviceMemoryBytes")),
            ),
            replicas=Replicas(
                min=int(replicas.get("min", Replicas.min)),
                max=int(replicas.get("max", Replicas.max)),
            ),
            checkpoint_root=str(_dict(spec, "checkpoint").get("root", cls.checkpoint_root)),
            token_secret=SecretRef(
                name=str(secret.get("name", SecretRef.name)),
                key=str(secret.get("key", SecretRef.key)),
            ),
            model_shape=_model_shape(_dict(spec, "modelShape")),
            allowed_target_modules=_strings_or(
                spec.get("allowedTargetModules"), cls.allowed_target_modules
            ),
            allowed_namespaces=_strings(spec.get("allowedNamespaces")),
            namespace_selector=spec.get("namespaceSelector"),
            dtype=None if spec.get("dtype") is None else str(spec["dtype"]),
            gradient_checkpointing=(
                None
                if spec.get("gradientCheckpointing") is None
                else bool(spec["gradientCheckpointing"])
            ),
            vllm=VLLMPlacement.from_obj(_dict(spec, "vllm")),
            queue_name=spec.get("queueName") or None,
            data_roots=_strings_or(spec.get("dataRoots"), cls.data_roots),
            reward_hosts=_strings_or(spec.get("rewardHosts"), cls.reward_hosts),
            gpus_per_engine=int(spec.get("gpusPerEngine", cls.gpus_per_engine)),
            shard_base=bool(spec.get("shardBase", cls.shard_base)),
            shm_size=str(_dict(spec, "template").get("shmSize", cls.shm_size)),
        )


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _model_shape(shape: Mapping[str, Any]) -> ModelShape | None:
    if not shape:
        return None  # the pool declares none: memory is not estimated or enforced
    return ModelShape(
        num_layers=int(shape["numLayers"]),
        hidden_size=int(shape["hiddenSize"]),
        intermediate_size=shape.get("intermediateSize"),
        kv_dim=shape.get("kvDim"),
    )


@dataclass(frozen=True)
class Pool:
    meta: Meta
    spec: PoolSpec
    raw: Mapping[str, Any] = field(compare=False, repr=False)

    @classmethod
    def from_obj(cls, obj: Mapping[str, Any]) -> Pool:
        return cls(meta=Meta.from_obj(obj), spec=PoolSpec.from_obj(_dict(obj, "spec")), raw=obj)

    @property
    def name(self) -> str:
        return self.meta.name

    @property
    def raw_spec(self) -> Mapping[str, Any]:
        return _dict(self.raw, "spec")

    @property
    def raw_status(self) -> Mapping[str, Any]:
        return _dict(self.raw, "status")
