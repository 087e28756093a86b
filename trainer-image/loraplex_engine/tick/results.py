"""What a tick's phases hand each other: an experiment's rollout, its rewards, its
update, or its failure; and the guard that turns an error in one experiment's own step
into that experiment's failure (tick/tick.py).

An experiment's step may carry the rows of one eval (spec.eval, evaluation/): they are
sampled in the same rollout batch and scored in the same reward call as its step's rows,
then kept apart: the eval's rewards never reach the update."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from loraplex_engine.environments.episodes import EpisodeGroup
from loraplex_engine.evaluation.eval_set import EvalRows
from loraplex_engine.experiment import Experiment
from loraplex_engine.rollout.base import Completion, RolloutRequest
from loraplex_engine.spec.api_types import ExperimentTick
from loraplex_engine.spec.errors import RewardError, TaskError
from loraplex_engine.spec.eval_scores import EvalResult, summarize
from loraplex_engine.tasks import Prompt
from loraplex_engine.train.strategy import TrainOutcome

_T = TypeVar("_T")
log = logging.getLogger("loraplex_engine.tick")


@dataclass(frozen=True)
class Rollout:
    """One experiment's step: its prompts (each repeated groupSize times), their requests
    and, after the rollout phase, their completions. ``evals``: the rows of an eval that
    rides along (None: none this tick), ``eval_completions`` theirs. A step with no
    prompt of its own only evaluates (its last adapter, after maxSteps)."""

    exp: Experiment
    prompts: list[Prompt]
    requests: list[RolloutRequest]
    completions: list[Completion] = field(default_factory=list)
    episodes: EpisodeGroup | None = None  # a multi-turn environment's (their rewards)
    evals: EvalRows | None = None
    eval_completions: list[Completion] = field(default_factory=list)
    version: int = 0  # the adapter's step (its weights' version) when this was planned
    planned_tick: int = 0  # the tick that planned it: orders an experiment's rollouts

    @property
    def rollout_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)

    @property
    def eval_only(self) -> bool:
        return not self.requests

    def all_requests(self) -> list[RolloutRequest]:
        return self.requests + (self.evals.requests if self.evals else [])

    def all_prompts(self) -> list[Prompt]:
        return self.prompts + (self.evals.prompts if self.evals else [])

    def eval_result(self, rewards: list[float]) -> EvalResult | None:
        """The eval's numbers from its rows' rewards (None: no eval rode along)."""
        if self.evals is None:
            return None
        ev = self.exp.eval_set.spec if self.exp.eval_set else None
        assert ev is not None
        completion_tokens = sum(len(c.token_ids) for c in self.eval_completions)
        prompt_tokens = sum(len(r.prompt_ids) for r in self.evals.requests)
        tokens = prompt_tokens + completion_tokens
        return summarize(
            rewards, ev.samples, ev.pass_at_k, ev.pass_threshold, self.evals.step, tokens
        )


@dataclass(frozen=True)
class Scored:
    rollout: Rollout
    rewards: list[float]  # of the step's rows
    eval: EvalResult | None = None  # of the eval that rode along


@dataclass(frozen=True)
class Trained:
    scored: Scored
    train_tokens: int
    outcome: TrainOutcome  # its statistics (the gap, TIS), finite or None
    dropped_groups: int = 0  # groups the dynamic-sampling filter left out
    skipped: bool = False  # no row trained (every group dropped, or eval only): no update


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


def score_one(r: Rollout, texts: list[str]) -> Scored | Failure:
    """One experiment's reward (on a pool thread): its step's rows and its eval's in one
    call to the task's reward (one round trip for an http reward)."""

    def score() -> Scored:
        rewards = [float(x) for x in r.exp.task.score(r.all_prompts(), texts)]
        bad = [x for x in rewards if not math.isfinite(x)]
        if bad:
            raise RewardError(f"reward returned a non-finite score ({bad[0]})")
        mine = len(r.prompts)
        return Scored(r, rewards[:mine], r.eval_result(rewards[mine:]))

    return guarded(r.exp, "reward_error", "reward", score)


def exp_of(item: Scored | Failure) -> Experiment:
    return item.rollout.exp if isinstance(item, Scored) else item.exp


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
        tracking=exp.plan.tracking,
    )


def record_eval(exp: Experiment, result: EvalResult | None) -> None:
    """The experiment's latest eval, for its status."""
    if result is not None:
        exp.last_eval = result
        exp.eval_tokens += result.tokens


def eval_only_tick(t: Trained) -> ExperimentTick:
    """The tick of an experiment that only evaluated its last adapter: it is done."""
    exp = t.scored.rollout.exp
    return ExperimentTick(
        exp.id,
        exp.namespace,
        exp.step,
        exp.reward or 0.0,
        0,
        0,
        name=exp.name,
        run_id=exp.run_id,
        tracking=exp.plan.tracking,
        finished=True,
        eval=t.scored.eval,
        eval_only=True,
    )


def publish_evals(
    after_eval: Callable[[Experiment, EvalResult], None] | None, scored: list[Scored]
) -> list[Scored | Failure]:
    """Each eval result reaches the publisher (versions/publisher.py ``after_eval``); one
    that fails there fails its experiment alone."""
    out: list[Scored | Failure] = []
    for s in scored:
        exp, result = s.rollout.exp, s.eval
        if after_eval is None or result is None:
            out.append(s)
            continue
        done = guarded(exp, "checkpoint_error", "publish", lambda e=exp, r=result: after_eval(e, r))
        out.append(done if isinstance(done, Failure) else s)
    return out
