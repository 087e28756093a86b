"""What a tick's phases hand each other: an experiment's rollout, its rewards, its
update, or its failure; and the guard that turns an error in one experiment's own step
into that experiment's failure (tick.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from loraplex_engine.api_types import ExperimentTick
from loraplex_engine.environments.episodes import EpisodeGroup
from loraplex_engine.errors import RewardError, TaskError
from loraplex_engine.experiment import Experiment
from loraplex_engine.rollout.base import Completion, RolloutRequest
from loraplex_engine.tasks import Prompt
from loraplex_engine.train.strategy import TrainOutcome

_T = TypeVar("_T")
log = logging.getLogger("loraplex_engine.tick")


@dataclass(frozen=True)
class Rollout:
    """One experiment's step: its prompts (each repeated groupSize times), their requests
    and, after the rollout phase, their completions."""

    exp: Experiment
    prompts: list[Prompt]
    requests: list[RolloutRequest]
    completions: list[Completion] = field(default_factory=list)
    episodes: EpisodeGroup | None = None  # a multi-turn environment's (their rewards)

    @property
    def rollout_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)


@dataclass(frozen=True)
class Scored:
    rollout: Rollout
    rewards: list[float]


@dataclass(frozen=True)
class Trained:
    scored: Scored
    train_tokens: int
    outcome: TrainOutcome  # its statistics (the gap, TIS), finite or None
    dropped_groups: int = 0  # groups the dynamic-sampling filter left out
    skipped: bool = False  # no row trained (every group dropped): no update


@dataclass(frozen=True)
class Failure:
    exp: Experiment
    reason: str  # the experiment's error text
    kind: str  # status.failureReason and the metrics label (api_types.FAILURE_REASONS)


def guarded(exp: Experiment, kind: str, what: str, step: Callable[[], _T]) -> _T | Failure:
    """Run one experiment's own step; any error in it fails that experiment alone.

    Broad on purpose: this is the boundary between a tenant's spec, data and reward
    service and the shared tick, and no tenant input may stop the engine."""
    try:
        return step()
    except Exception as e:
        if not isinstance(e, RewardError | TaskError | ValueError):
            log.warning("experiment %s: %s failed", exp.id, what, exc_info=True)
        return Failure(exp, f"{what} failed: {describe(e)}", kind)


def describe(e: Exception) -> str:
    """One line: the error's message, with its class when that is not one of ours."""
    text = " ".join(str(e).split())[:500] or "(no message)"
    if isinstance(e, RewardError | TaskError):
        return text
    return f"{type(e).__name__}: {text}"


def first_error(completions: list[Completion]) -> str | None:
    return next((c.error for c in completions if c.error is not None), None)


def keep(results: list[_T | Failure], failures: list[Failure]) -> list[_T]:
    """The experiments that carry on; the others are failed now and recorded."""
    kept: list[_T] = []
    for result in results:
        if isinstance(result, Failure):
            result.exp.fail(result.reason, result.kind)
            failures.append(result)
        else:
            kept.append(result)
    return kept


def failed(f: Failure) -> ExperimentTick:
    exp = f.exp
    return ExperimentTick(
        exp.id,
        exp.namespace,
        exp.step,
        exp.reward or 0.0,
        0,
        0,
        failed_reason=f.kind,
        name=exp.name,
        run_id=exp.run_id,
        tracking=exp.spec.tracking,
    )
