"""The experiment spec's ``publish`` block: when versions are published, how many are
kept, and the aliases that point at them (spec/experiment.py imports it; free of torch and I/O)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from loraplex_engine.spec.schema import CelRule, Int32, ListMap, ListSet, SpecModel

# A version as the spec and the model names write it: "v" and a number from 1.
VersionRef = Annotated[str, Field(pattern=r"^v[1-9][0-9]{0,8}$", max_length=10)]
ALIAS_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# The alias the engine moves to every new version itself.
LATEST = "latest"
# The alias the promotion gate moves.
STABLE = "stable"
# Scores a version can be gated on (store/versions.py Manifest.scores). meanReward: the
# mean of the training reward over the steps since the previous version; evalReward and
# evalPassAtK: spec.eval's (spec/eval_scores.py) of the eval at or latest before the
# version's step.
ScoreName = Literal["meanReward", "evalReward", "evalPassAtK"]
EvalScoreName = Literal["evalReward", "evalPassAtK"]
EVAL_SCORES: tuple[str, ...] = ("evalReward", "evalPassAtK")
# A publish request's token (publish.requestToken): a label value's alphabet.
TOKEN_PATTERN = r"^[A-Za-z0-9]([-._A-Za-z0-9]{0,61}[A-Za-z0-9])?$"

# spec-level rules (ExperimentSpec.CEL_RULES): an eval score exists only with spec.eval.
GATE_NEEDS_EVAL = CelRule(
    "!has(self.publish) || !has(self.publish.promoteWhen) || "
    "!has(self.publish.promoteWhen.score) || self.publish.promoteWhen.score == 'meanReward' "
    "|| has(self.eval)",
    "spec.publish.promoteWhen gates on an eval score (evalReward, evalPassAtK) only with "
    "spec.eval, the eval that computes it; set spec.eval or gate on meanReward",
    "publish.promoteWhen.score",
    lambda spec: (
        spec.publish is None
        or spec.publish.promote_when is None
        or spec.publish.promote_when.score not in EVAL_SCORES
        or spec.evaluation is not None
    ),
)
ON_EVAL_NEEDS_EVAL = CelRule(
    "!has(self.publish) || !has(self.publish.onEvalImprovement) || has(self.eval)",
    "spec.publish.onEvalImprovement publishes after an eval, so it needs spec.eval (the eval "
    "that scores the adapter); set spec.eval or leave it unset",
    "publish.onEvalImprovement",
    lambda spec: (
        spec.publish is None
        or spec.publish.on_eval_improvement is None
        or spec.evaluation is not None
    ),
)


class AliasSpec(SpecModel):
    """One alias set by hand: its name points at a version."""

    CEL_RULES: ClassVar = (
        CelRule(
            f"self.name != '{LATEST}'",
            f"publish.aliases: '{LATEST}' is the engine's own alias (always the newest "
            "version); it cannot be set by hand",
            "name",
            lambda a: a.name != LATEST,
        ),
    )

    name: str = Field(
        min_length=1,
        max_length=32,
        pattern=ALIAS_PATTERN,
        description="The alias (stable, canary, ...): served as <namespace>.<name>:<alias>.",
    )
    version: VersionRef = Field(description="The version it points at, e.g. v3.")


class PromoteWhen(SpecModel):
    """The promotion gate: a new version becomes ``stable`` only if its score passes."""

    score: ScoreName = Field(
        "meanReward",
        description="Which score of the version is gated: meanReward = the mean training "
        "reward over the steps since the previous version; evalReward, evalPassAtK = "
        "spec.eval's scores of the eval at (or the latest before) the version's step (needs "
        "spec.eval; a version without one never becomes stable).",
    )
    at_least: float = Field(
        alias="atLeast",
        ge=-1e9,
        le=1e9,
        description="The version becomes stable when its score is at least this; a version "
        "below it never becomes stable, by the gate or by hand.",
    )


class PublishSpec(SpecModel):
    """Published versions: immutable PEFT directories, served as <ns>.<name>@v<N> and
    through aliases (<ns>.<name>:stable). Mutable in place: the engine applies an edit
    (aliases, pins, policy) without restarting the experiment."""

    every_steps: Int32 | None = Field(
        None,
        ge=1,
        alias="everySteps",
        description="Publish a version every this many optimiser steps. Absent = not on a "
        "step count (onEvalImprovement, requestToken, or the engine's publish route).",
    )
    on_eval_improvement: EvalScoreName | None = Field(
        None,
        alias="onEvalImprovement",
        description="Publish a version after each eval (spec.eval) whose score (evalReward "
        "or evalPassAtK, named here) beats every published version's; the untrained adapter "
        "(step 0) is not published. Together with everySteps both apply. Absent = off.",
    )
    request_token: str | None = Field(
        None,
        min_length=1,
        max_length=63,
        pattern=TOKEN_PATTERN,
        alias="requestToken",
        description="Publish one version now: each new value publishes once (kubectl patch, "
        "GitOps). The token is recorded in the version's manifest and the status, so a "
        "resumed engine does not publish it again. Letters, digits, '-', '_', '.'.",
    )
    keep: Int32 = Field(
        5,
        ge=1,
        le=1000,
        description="Versions kept: the newest this many, plus the pinned ones and those an "
        "alias points at; older ones are deleted after each publish. Counted in the "
        "namespace's checkpoint quota.",
    )
    pinned: Annotated[list[VersionRef], Field(max_length=64), ListSet()] = Field(
        default_factory=list,
        description="Versions never deleted by retention, e.g. [v3].",
    )
    aliases: Annotated[list[AliasSpec], Field(max_length=32), ListMap("name")] = Field(
        default_factory=list,
        description="Aliases set by hand (e.g. [{name: stable, version: v3}]): a promotion "
        "or rollback is an edit of this list (kubectl patch, GitOps). 'latest' is the "
        "engine's own. A 'stable' set here overrides the gate until it is removed.",
    )
    promote_when: PromoteWhen | None = Field(
        None,
        alias="promoteWhen",
        description="The gate for 'stable': each new version whose score passes becomes "
        "stable (unless aliases sets stable by hand). Absent = stable only by hand.",
    )

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, mode="json", exclude_none=True)


# spec.ExperimentSpec's field (here: spec/experiment.py is at its size limit).
PUBLISH_FIELD: Any = Field(
    None,
    description="Published versions of the adapter and their aliases, for continual "
    "experiments whose adapters serve as they improve (docs/versions.md). Absent = none "
    "published. Mutable in place.",
)


def hand_aliases(spec: PublishSpec | None) -> dict[str, int]:
    """The spec's aliases as alias -> version number."""
    if spec is None:
        return {}
    return {a.name: int(a.version[1:]) for a in spec.aliases}


def pinned_versions(spec: PublishSpec | None) -> set[int]:
    return set() if spec is None else {int(v[1:]) for v in spec.pinned}
