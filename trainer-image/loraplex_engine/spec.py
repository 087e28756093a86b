"""The experiment spec: the ``LoRAExperiment`` custom resource's ``spec``, field for field.

Mirrors docs/engine-api.md (camelCase names, same defaults and bounds as the CRD).
Unknown fields are rejected, so a typo never silently falls back to a default.
Kept free of torch and I/O: the HTTP layer and the local runner validate with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from loraplex_engine.errors import SpecError, TaskError

TaskName = Literal["target-token", "copy", "arithmetic", "jsonl"]
# "default" = the task's own verifier; kept equal to tasks.REWARD_NAMES (tested).
RewardName = Literal[
    "default", "exact-match", "contains", "prefix-overlap", "word-fraction", "coverage", "http"
]
AlgorithmName = Literal["grpo"]
ModuleName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.]*$", max_length=128)]


class _Model(BaseModel):
    # strict: no "8" → 8 coercion, as the CRD's OpenAPI types would reject it too.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


class LoraSpec(_Model):
    rank: int = Field(8, ge=1, le=256)
    alpha: float = Field(16.0, gt=0, le=4096)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[ModuleName] = Field(
        default=["q_proj", "v_proj"], alias="targetModules", min_length=1
    )


class TaskSpec(_Model):
    name: TaskName
    params: dict[str, str] = Field(default_factory=dict)
    dataset: str | None = Field(None, min_length=1)
    reward: RewardName | None = None  # None = the task's own reward
    reward_url: str | None = Field(None, alias="rewardUrl", pattern=r"^https?://")

    @model_validator(mode="after")
    def _required_together(self) -> TaskSpec:
        # ctx["field"] lets parse_spec name the missing field, not just "task".
        if self.name == "jsonl" and not self.dataset:
            raise PydanticCustomError(
                "missing_field", "dataset is required for task jsonl", {"field": "dataset"}
            )
        if self.reward == "http" and not self.reward_url:
            raise PydanticCustomError(
                "missing_field", "rewardUrl is required when reward is http", {"field": "rewardUrl"}
            )
        return self


class AlgorithmSpec(_Model):
    name: AlgorithmName = "grpo"
    group_size: int = Field(8, ge=2, le=256, alias="groupSize")
    prompts_per_step: int = Field(4, ge=1, le=1024, alias="promptsPerStep")
    learning_rate: float = Field(5e-4, gt=0, le=1, alias="learningRate")
    kl_coef: float = Field(0.0, ge=0, alias="klCoef")
    clip: float = Field(0.2, gt=0, le=1)
    max_steps: int = Field(50, ge=0, alias="maxSteps")  # 0 = continual
    seed: int = Field(0, ge=0)


class RolloutSpec(_Model):
    max_new_tokens: int = Field(64, ge=1, le=4096, alias="maxNewTokens")
    temperature: float = Field(1.0, ge=0, le=2)  # 0 = greedy


class CheckpointSpec(_Model):
    every_steps: int = Field(10, ge=1, alias="everySteps")
    keep: int = Field(3, ge=1, le=1000)


class ExperimentSpec(_Model):
    engine_pool: str | None = Field(None, alias="enginePool")  # operator only
    lora: LoraSpec = Field(default_factory=LoraSpec)
    task: TaskSpec
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)  # operator only
    suspend: bool = False  # operator only

    def to_json(self) -> dict[str, Any]:
        """camelCase dict, as the CRD and the HTTP API carry it."""
        return self.model_dump(by_alias=True, mode="json", exclude_none=True)

    def validate_for_engine(self, max_rank: int, known_modules: Iterable[str]) -> None:
        """Checks that depend on the engine (pool limits, base model); raise ``SpecError``."""
        if self.lora.rank > max_rank:
            raise SpecError(
                "spec.lora.rank", f"rank {self.lora.rank} exceeds the engine's max rank {max_rank}"
            )
        known = set(known_modules)
        unknown = [m for m in self.lora.target_modules if m not in known]
        if unknown:
            raise SpecError(
                "spec.lora.targetModules",
                f"unknown module(s) {unknown}; this engine supports {sorted(known)}",
            )
        self.check_task()

    def check_task(self) -> None:
        """Task parameters (free-form in the schema) against the task's known ones."""
        # Imported here: tasks pull in httpx; parsing a spec should not need it.
        from loraplex_engine.tasks import check_task

        try:
            check_task(self.task.name, self.task.params)
        except TaskError as exc:
            raise SpecError(exc.field, exc.message) from None


def _field_path(err: Mapping[str, Any], prefix: str) -> str:
    loc = [str(part) for part in err.get("loc", ())]
    extra = (err.get("ctx") or {}).get("field")
    if extra:
        loc.append(str(extra))
    return ".".join([prefix, *loc]) if loc else prefix


def spec_error_from(exc: ValidationError, prefix: str = "spec") -> SpecError:
    """The first pydantic error as a ``SpecError`` whose message names the field path."""
    err = exc.errors()[0]
    path = _field_path(err, prefix)
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
    more = len(exc.errors()) - 1
    if more:
        msg += f" (and {more} more error{'s' if more > 1 else ''})"
    return SpecError(path, msg)


def parse_spec(data: Any, prefix: str = "spec") -> ExperimentSpec:
    """Validate a camelCase spec dict; raise ``SpecError`` naming the first bad field."""
    if not isinstance(data, Mapping):
        raise SpecError(prefix, f"must be a mapping, got {type(data).__name__}")
    try:
        return ExperimentSpec.model_validate(data)
    except ValidationError as exc:
        raise spec_error_from(exc, prefix) from None


def all_spec_errors(data: Any, prefix: str = "spec") -> list[SpecError]:
    """Every problem at once (for messages that list them all)."""
    try:
        ExperimentSpec.model_validate(data)
    except ValidationError as exc:
        return [SpecError(_field_path(e, prefix), e["msg"]) for e in exc.errors()]
    return []


__all__ = [
    "AlgorithmSpec",
    "CheckpointSpec",
    "ExperimentSpec",
    "LoraSpec",
    "RolloutSpec",
    "TaskSpec",
    "all_spec_errors",
    "parse_spec",
    "spec_error_from",
]
