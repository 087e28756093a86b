"""The operator's API group and typed, read-only views of its two resources.

`Experiment.from_obj` and `Pool.from_obj` read a raw object (from kopf or the API
server) once; the rest of the operator reads fields, not `.get("…", default)` chains.
A pool's spec is the API model the EnginePool CRD is generated from
(`api.pool.EnginePoolSpec`), so its defaults are stated once. An experiment's spec is
the engine's (`loraplex_engine/spec/experiment.py`, not in the operator image): the few fields the
operator reads are plain dataclasses here, whose defaults tests/operator/test_resources.py
checks against crds/loraexperiments.yaml. A view keeps its raw object (`raw`) for what
is passed on untouched: the spec the engine is given and the object Events refer to.
The statuses the operator writes are API models (`api.status`); an experiment's
`LastStatus` is the few fields planning reads of the one written last.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from loraplex_operator.api.pool import EnginePoolSpec
from loraplex_operator.api.status import EnginePoolStatus

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


def _string(value: Any) -> str | None:
    return None if value is None else str(value)


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
    priority_class_name: str | None = None  # None: the default class (value 0)
    # The retired raw priority as written (None: absent); admission refuses any but 0.
    priority: int | None = None
    suspend: bool = False
    lora: Lora = field(default_factory=Lora)
    algorithm: Algorithm = field(default_factory=Algorithm)
    # spec.client set: its Tinker client trains it (no task; modules chosen by kind).
    client: bool = False

    @classmethod
    def from_obj(cls, spec: Mapping[str, Any]) -> ExperimentSpec:
        lora, algorithm = _dict(spec, "lora"), _dict(spec, "algorithm")
        return cls(
            engine_pool=str(spec.get("enginePool", cls.engine_pool)),
            priority_class_name=_string(spec.get("priorityClassName")),
            priority=None if spec.get("priority") is None else int(spec["priority"]),
            suspend=bool(spec.get("suspend", cls.suspend)),
            lora=Lora(
                rank=int(lora.get("rank", Lora.rank)),
                target_modules=_strings(lora.get("targetModules")),
            ),
            algorithm=Algorithm(max_steps=int(algorithm.get("maxSteps", Algorithm.max_steps))),
            client=isinstance(spec.get("client"), Mapping),
        )


@dataclass(frozen=True)
class CheckpointRef:
    path: str | None = None
    step: int | None = None


@dataclass(frozen=True)
class LastStatus:
    """What the operator wrote last (its memory, not the truth: engines are); read laxly,
    for planning. `status.derive_status` reads the whole of it as `api.status.ExperimentStatus`."""

    phase: str | None = None
    engine: str | None = None
    node: str | None = None
    restarts: int = 0
    checkpoint: CheckpointRef = field(default_factory=CheckpointRef)
    conditions: tuple[Mapping[str, Any], ...] = ()

    @classmethod
    def from_obj(cls, status: Mapping[str, Any]) -> LastStatus:
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
    status: LastStatus
    raw: Mapping[str, Any] = field(compare=False, repr=False)

    @classmethod
    def from_obj(cls, obj: Mapping[str, Any]) -> Experiment:
        return cls(
            meta=Meta.from_obj(obj),
            spec=ExperimentSpec.from_obj(_dict(obj, "spec")),
            status=LastStatus.from_obj(_dict(obj, "status")),
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
class Pool:
    meta: Meta
    spec: EnginePoolSpec
    raw: Mapping[str, Any] = field(compare=False, repr=False)

    @classmethod
    def from_obj(cls, obj: Mapping[str, Any]) -> Pool:
        return cls(
            meta=Meta.from_obj(obj), spec=EnginePoolSpec.from_obj(_dict(obj, "spec")), raw=obj
        )

    @property
    def name(self) -> str:
        return self.meta.name

    @property
    def raw_status(self) -> Mapping[str, Any]:
        return _dict(self.raw, "status")

    @property
    def status(self) -> EnginePoolStatus:
        """The status written last, typed (the API server validated it against the CRD)."""
        return EnginePoolStatus.model_validate(self.raw_status)
