"""What the trackers record, made from a tick's report (pure).

One :class:`StepRecord` per experiment that stepped (its metrics at its step) or ended
(its run is closed), and one more per eval scored (spec.eval: its metrics at the step of
the adapter it evaluated, one before the step it rode along with). The run is the
engine's: one per experiment run, found again by its
``loraplex.runId`` tag after a restart; the tenant's spec.tracking only names it and adds
tags, and the system tags (namespace, experiment, run id, pool) are set last, so a tenant
can override none of them (its tag names have no dot: spec/tracking.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from loraplex_engine.spec.api_types import ExperimentTick, TickReport
from loraplex_engine.spec.eval_scores import EvalResult

# An eval's metrics (docs/evaluation.md), recorded at the evaluated adapter's step.
EVAL_METRICS = ("eval_reward", "eval_pass_at_k", "eval_tokens")
# The metric names every tracker records (docs/tracking.md).
METRICS = (
    "reward_mean",
    "reward_std",
    "kl",
    "entropy",
    "clip_fraction",
    "response_length",
    "step_seconds",
    "rollout_tokens",
    "train_tokens",
    "logprob_gap",
    "tis_weight_mean",
    "dropped_groups",
    "rollout_version",
    "rollout_staleness",
    *EVAL_METRICS,
)
SYSTEM_TAG_PREFIX = "loraplex."


@dataclass(frozen=True)
class RunRef:
    """The run one experiment's steps go to."""

    namespace: str
    experiment: str  # the LoRAExperiment's name
    run_id: str  # the engine's run id (the operator's: the object's uid)
    run_name: str
    tags: dict[str, str] = field(default_factory=dict, hash=False, compare=False)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.namespace, self.experiment, self.run_id)


@dataclass(frozen=True)
class StepRecord:
    run: RunRef
    step: int
    timestamp_ms: int
    metrics: dict[str, float] = field(default_factory=dict)
    end: str | None = None  # "FINISHED" or "FAILED": the run ends with this step


def run_of(tick: ExperimentTick, pool: str) -> RunRef:
    """``tick``'s run: named by its spec.tracking (or after the experiment), tagged with the
    tenant's tags and, over them, the system's."""
    name = tick.name or tick.id
    tracking = tick.tracking
    tags = tracking.tag_map() if tracking is not None else {}
    tags = {k: v for k, v in tags.items() if not k.startswith(SYSTEM_TAG_PREFIX)}
    tags |= {
        "loraplex.namespace": tick.namespace,
        "loraplex.experiment": name,
        "loraplex.runId": tick.run_id,
        "loraplex.pool": pool,
    }
    run_name = (tracking.run_name if tracking is not None else None) or name
    return RunRef(tick.namespace, name, tick.run_id, run_name, tags)


def metrics_of(tick: ExperimentTick, seconds: float) -> dict[str, float]:
    """The step's metrics, each under its METRICS name; unknown or non-finite ones left
    out (a tracker cannot hold a NaN everywhere, and 'not measured' is no number)."""
    values = {
        "reward_mean": tick.reward,
        "reward_std": tick.reward_std,
        "kl": tick.kl,
        "entropy": tick.entropy,
        "clip_fraction": tick.clip_fraction,
        "response_length": tick.response_tokens,
        "step_seconds": seconds,
        "rollout_tokens": tick.rollout_tokens,
        "train_tokens": tick.train_tokens,
        "logprob_gap": tick.logprob_gap,
        "tis_weight_mean": tick.tis_weight_mean,
        "dropped_groups": tick.dropped_groups,
        # The weights that sampled the step's rollout (docs/design/pipeline.md): the run
        # can be replayed knowing them; a lag above 0 only under the pipelined schedule.
        "rollout_version": tick.rollout_version,
        "rollout_staleness": tick.step - 1 - tick.rollout_version,
    }
    return {k: float(x) for k, x in values.items() if x is not None and math.isfinite(x)}


def eval_metrics_of(result: EvalResult) -> dict[str, float]:
    """An eval's metrics, each under its EVAL_METRICS name."""
    values = (result.reward, result.pass_at_k, result.tokens)
    return {k: float(x) for k, x in zip(EVAL_METRICS, values, strict=True) if math.isfinite(x)}


def records_of(report: TickReport, pool: str, now_ms: int) -> list[StepRecord]:
    """One record per experiment of ``report`` with a run (a tick with an experiment
    carries its run id); a failed one closes its run, with no metrics."""
    out: list[StepRecord] = []
    for tick in report.experiments:
        if not tick.run_id:
            continue
        run = run_of(tick, pool)
        if tick.failed_reason is not None:
            out.append(StepRecord(run, tick.step, now_ms, end="FAILED"))
            continue
        end = "FINISHED" if tick.finished else None
        if tick.eval is not None:  # an eval-only tick (the last adapter's) ends the run
            ev_end = end if tick.eval_only else None
            out.append(StepRecord(run, tick.eval.step, now_ms, eval_metrics_of(tick.eval), ev_end))
        if tick.eval_only:
            continue
        out.append(StepRecord(run, tick.step, now_ms, metrics_of(tick, report.seconds), end))
    return out
