"""spec.eval on a real engine (the tiny model, torch rollout): evals at step 0, every
everySteps and of the final adapter, reported in the tick, the status, the metrics and
the trackers' records; a greedy eval that rises as the adapter learns; the same numbers
recomputed from the final checkpoint on another engine; and training left exactly as it
is without an eval."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from loraplex_engine.engine import Engine
from loraplex_engine.metrics import EngineMetrics
from loraplex_engine.spec.api_types import ExperimentTick
from loraplex_engine.spec.errors import InvalidSpecError
from loraplex_engine.tracking.records import StepRecord, records_of

from tests.support.adapter_parity import adapter_gap, assert_same_training
from tests.support.engine_builders import engine, spec

STEPS, EVERY, LR = 10, 2, 0.02
EXP = "default.say-yes"
GREEDY = {"everySteps": EVERY, "prompts": 8}
SAMPLED = {"everySteps": EVERY, "prompts": 4, "samples": 4, "passAtK": 2, "temperature": 1.0}
# target-token ("yes", coverage reward) on the tiny model: the greedy completion of every
# eval prompt scores 0.0 before training and 1.0 from step 8 on (seed 0, measured); the
# sampled training reward is still ~0.4 at step 10. A rise of half the reward's range
# cannot come from noise (greedy has none) and asks for half of what was measured.
MIN_EVAL_RISE = 0.5


@dataclass
class Run:
    """One experiment trained to its end: its ticks, and what the engine's metrics and
    the trackers made of the reports."""

    ticks: list[ExperimentTick] = field(default_factory=list)
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    records: list[StepRecord] = field(default_factory=list)


def _run(eng: Engine, ev: dict[str, Any] | None, resume_from: str | None = None) -> Run:
    extra = {} if ev is None else {"eval": ev}
    eng.put_experiment(EXP, spec(steps=STEPS, lr=LR, **extra), "default", "say-yes", resume_from)
    run = Run()
    for _ in range(100):
        report = eng.tick()
        if report is None:
            return run
        run.metrics.observe_tick(report)
        run.ticks += [t for t in report.experiments if t.id == EXP]
        run.records += records_of(report, "pool", 0)
    raise AssertionError("still running after 100 ticks")


@pytest.fixture(scope="module")
def greedy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    eng = engine(tiny_model_dir, tmp_path_factory.mktemp("greedy"))
    return eng, _run(eng, GREEDY)  # (the engine, its Run)


def test_evals_at_zero_every_k_and_after_the_last_step(greedy) -> None:
    eng, run = greedy
    ticks = run.ticks
    assert all(t.failed_reason is None for t in ticks), ticks
    steps = [t for t in ticks if not t.eval_only]
    assert [t.step for t in steps] == list(range(1, STEPS + 1))
    # The eval of the adapter at step s rides the tick that takes step s + 1.
    assert [(t.step, t.eval.step) for t in steps if t.eval] == [
        (1, 0),
        (3, 2),
        (5, 4),
        (7, 6),
        (9, 8),
    ]
    last = ticks[-1]
    assert last.eval_only and last.finished and last.eval is not None
    assert (last.step, last.eval.step, last.rollout_tokens, last.train_tokens) == (
        STEPS,
        STEPS,
        0,
        0,
    )
    assert [t.finished for t in ticks].count(True) == 1  # the run ends once, evaluated
    status = eng.get_experiment(EXP)
    assert status.phase == "Succeeded" and status.step == STEPS
    assert (status.eval_step, status.eval_reward, status.eval_pass_at_k, status.eval_k) == (
        STEPS, last.eval.reward, last.eval.pass_at_k, 1,
    )  # fmt: skip
    evals = [t.eval for t in ticks if t.eval]
    assert status.eval_tokens == sum(e.tokens for e in evals)
    # Eval rows are not the step's: rolloutTokens counts the steps' completions alone.
    assert status.rollout_tokens == sum(t.rollout_tokens for t in steps)
    # 8 prompts, each its prompt and at most maxNewTokens (8) generated tokens.
    assert all(e.prompts == 8 and e.samples == 1 and e.k == 1 for e in evals)
    # Same 8 prompts each eval: their tokens differ by the completions alone (0 to 8 each).
    assert max(e.tokens for e in evals) - min(e.tokens for e in evals) <= 8 * 8


def test_greedy_eval_rises_as_the_adapter_learns(greedy) -> None:
    ticks = greedy[1].ticks
    curve = [(t.eval.step, t.eval.reward, t.eval.pass_at_k) for t in ticks if t.eval]
    first, final = curve[0], curve[-1]
    assert final[1] >= first[1] + MIN_EVAL_RISE, curve
    # pass@1 of a greedy eval: the share of prompts whose completion scored >= 1.0.
    assert final[2] >= first[2] + MIN_EVAL_RISE, curve


def test_metrics_and_trackers_carry_the_evals(greedy) -> None:
    run = greedy[1]
    ticks = run.ticks
    last = ticks[-1].eval
    labels = {"namespace": "default", "experiment": EXP}
    sample = run.metrics.registry.get_sample_value
    assert sample("loraplex_engine_eval_reward", labels) == last.reward
    assert sample("loraplex_engine_eval_pass_at_k", labels) == last.pass_at_k
    assert sample("loraplex_engine_eval_tokens_total", labels) == sum(
        t.eval.tokens for t in ticks if t.eval
    )
    assert sample("loraplex_engine_steps_total", labels) == STEPS  # the eval-only tick: no step
    # The trackers: each eval at its adapter's step, the final one closing the run.
    evals = [
        (r.step, r.metrics["eval_reward"], r.end) for r in run.records if "eval_reward" in r.metrics
    ]
    want = [(t.eval.step, t.eval.reward, None) for t in ticks if t.eval]
    want[-1] = (*want[-1][:2], "FINISHED")
    assert evals == want
    assert [r.end for r in run.records].count("FINISHED") == 1 and run.records[-1].end == "FINISHED"


def test_the_final_eval_is_recomputed_from_the_final_checkpoint(greedy, tiny_model_dir) -> None:
    """Another engine resumes the final checkpoint: before it is Succeeded, it evaluates
    that adapter alone in its batch, as the first engine's last tick did: same weights
    (fp32 safetensors), same rows, same batch, so the same greedy tokens and numbers."""
    eng, run = greedy
    ticks = run.ticks
    final = eng.get_experiment(EXP).checkpoint
    assert final is not None and final.step == STEPS
    # The same checkpoint volume, as another engine of the pool sees it.
    other = engine(tiny_model_dir, eng.store.root)
    again = _run(other, GREEDY, resume_from=final.path).ticks
    assert [t.eval_only for t in again] == [True]
    assert again[0].eval == ticks[-1].eval
    status = other.get_experiment(EXP)
    assert status.phase == "Succeeded" and status.eval_reward == ticks[-1].eval.reward


def test_a_sampled_eval_repeats_run_to_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    runs = [_run(engine(tiny_model_dir, tmp_path / str(i)), SAMPLED).ticks for i in range(2)]
    evals = [[t.eval for t in ticks if t.eval] for ticks in runs]
    assert len(evals[0]) == STEPS // EVERY + 1 and evals[0] == evals[1]
    assert all(e.samples == 4 and e.k == 2 and e.prompts == 4 for e in evals[0])


@pytest.mark.numeric
def test_an_eval_leaves_training_as_it_is_without_one(greedy, tiny_model_dir, tmp_path) -> None:
    """Eval rows never train and draw nothing from the training samples' generator: the
    reward curve and the adapter match a run without spec.eval. As in test_engine_rl's
    fused-vs-alone test, the only difference is float rounding (the eval's rows share the
    rollout batch, which pads differently), within adapter_parity's tolerances."""
    eng, run = greedy
    ticks = run.ticks
    plain_eng = engine(tiny_model_dir, tmp_path)
    plain = _run(plain_eng, None).ticks
    assert all(t.eval is None for t in plain)
    with_eval = [t.reward for t in ticks if not t.eval_only]
    assert [t.reward for t in plain] == pytest.approx(with_eval, abs=1e-6)
    mine = plain_eng.model.adapter_state_dict(EXP)
    theirs = eng.model.adapter_state_dict(EXP)
    assert_same_training({EXP: adapter_gap(mine, theirs, LR, STEPS)})


def test_an_eval_dataset_the_engine_may_not_read_is_refused(tiny_model_dir, tmp_path) -> None:
    eng = engine(tiny_model_dir, tmp_path)
    bad = spec(steps=2, eval={"dataset": "/etc/passwd"})
    with pytest.raises(InvalidSpecError) as info:
        eng.put_experiment(EXP, bad, "default", "say-yes")
    assert info.value.field == "spec.eval.dataset" and "not allowed" in info.value.message
    assert eng.list_experiments() == []
