"""The trainer's own old log-probs (training.score_rows) and the off-policy gap.

The torch rollout samples with the trainer's model, so its log-probs are the old
policy's: recomputing them must give them back (fp32 tolerance), on every path the
update runs (shared prompt prefixes or not, a LoRA-adapted lm_head or a frozen one).
That proves the recompute path the vLLM backend relies on; the vLLM end to end is in
test_vllm_off_policy.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loraplex_engine.metrics import EngineMetrics
from loraplex_engine.rollout.base import RolloutRequest
from loraplex_engine.spec.api_types import ExperimentTick, TickReport
from loraplex_engine.train.rows import TrainRow
from loraplex_engine.train.strategy import (
    StepTotals,
    TrainOutcome,
    gap_totals,
    logprob_gaps,
    mean_gaps,
    with_totals,
)

from tests.support.engine_builders import engine, spec

QV = {"rank": 4, "alpha": 8, "targetModules": ["q_proj", "v_proj"]}  # frozen head
TOL = 2e-5  # fp32: the decode (KV cache, one token at a time) vs one full forward


def _rows(eng, exp_id: str, prompts: list[list[int]], group: int) -> list[TrainRow]:
    """Rollouts through the engine's own torch backend, as the tick builds its rows."""
    slot = eng.model.slot_of(exp_id)
    gen = torch.Generator().manual_seed(3)
    requests = [
        RolloutRequest(slot, p, 6, 0.8, generator=gen, group=exp_id, adapter=exp_id)
        for p in prompts
        for _ in range(group)
    ]
    eng.model.eval()
    outs = eng.backend.generate(requests)
    return [
        TrainRow(exp_id, slot, r.prompt_ids, c.token_ids, c.logprobs, 0.5, 0.8, i // group)
        for i, (r, c) in enumerate(zip(requests, outs, strict=True))
        if c.token_ids
    ]


@pytest.mark.parametrize(
    ("share", "checkpointing"),
    [(True, False), (False, False), (True, True)],
    ids=["shared-prefix", "unshared", "checkpointed"],  # checkpointed: trains unshared
)
def test_recomputed_old_logprobs_are_the_torch_rollouts_own(
    tiny_model_dir: Path, tmp_path: Path, share: bool, checkpointing: bool
) -> None:
    eng = engine(
        tiny_model_dir, tmp_path, share_prompt_prefix=share, gradient_checkpointing=checkpointing
    )
    assert eng.strategy.recompute_old_logprobs is False  # torch: nothing to recompute
    try:
        eng.put_experiment("default.head", spec(steps=2), "default", "head")  # lm_head LoRA
        eng.put_experiment("default.qv", spec(steps=2, lora=QV, seed=1), "default", "qv")
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():  # B starts at zero: make every adapter matter
            for layer in eng.model.lora_layers.values():
                layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=gen) * 0.3)
        rows = [
            *_rows(eng, "default.head", [[1, 5, 6, 7], [1, 9]], 3),
            *_rows(eng, "default.qv", [[1, 40, 41, 42, 43]], 4),
        ]
        eng.strategy.recompute_old_logprobs = True
        eng.model.train()  # as the tick calls the strategy: the recompute turns eval on
        rescored, gaps = eng.strategy.with_trainer_old_logprobs(rows)
        assert eng.model.training  # and back
        for before, after in zip(rows, rescored, strict=True):
            assert after.behaviour_logprobs == before.old_logprobs
            assert len(after.old_logprobs) == len(before.completion_ids)
            assert after.old_logprobs == pytest.approx(before.old_logprobs, abs=TOL)
        assert set(gaps) == {"default.head", "default.qv"}
        assert all(0.0 <= g < TOL for g in gaps.values()), gaps
        # The adapters matter here: the base alone scores the same tokens differently.
        base = [r.__class__(**{**r.__dict__, "slot": 0}) for r in rows]
        _, base_gaps = eng.strategy.with_trainer_old_logprobs(base)
        assert min(base_gaps.values()) > 100 * TOL, base_gaps
    finally:
        eng.close()


@pytest.mark.parametrize("mode", ["fused", "timesliced"])
def test_a_tick_reports_the_gap_it_measured(tiny_model_dir: Path, tmp_path: Path, mode) -> None:
    """Forced on for the torch rollout, the recompute runs inside the tick (either
    strategy), with TIS on, and the tick, the status and /metrics carry the (~0) gap and
    the (~1) TIS weight, which weighted every sampled token."""
    eng = engine(tiny_model_dir, tmp_path, train_mode=mode)
    metrics = EngineMetrics()
    try:
        eng.strategy.recompute_old_logprobs = True
        alg = {"maxSteps": 2, "offPolicyCorrection": "tis", "tisCap": 1.5, "groupSize": 4}
        eng.put_experiment("default.a", spec(algorithm=alg), "default", "a")
        report = eng.tick()
        assert report is not None
        metrics.observe_tick(report)
        (tick,) = report.experiments
        assert tick.logprob_gap is not None and 0.0 <= tick.logprob_gap < TOL
        assert eng.get_experiment("default.a").logprob_gap == tick.logprob_gap
        assert tick.tis_weight_mean == pytest.approx(1.0, abs=TOL)
        assert tick.tis_tokens == tick.rollout_tokens > 0
        status = eng.get_experiment("default.a")
        assert status.tis_weight_mean == tick.tis_weight_mean
        assert status.to_json()["tisWeightMean"] == tick.tis_weight_mean
        text = metrics.render().decode()
        assert 'loraplex_engine_logprob_gap{experiment="default.a",namespace="default"}' in text
        assert 'loraplex_engine_tis_weight_mean{experiment="default.a",namespace="d' in text
    finally:
        eng.close()


def test_gap_gauge_only_where_measured_and_dropped_with_the_experiment() -> None:
    m = EngineMetrics()
    m.observe_tick(
        TickReport(
            0.1,
            {},
            [
                ExperimentTick("x.v", "x", 1, 0.5, 8, 16, logprob_gap=0.0123, tis_weight_mean=0.97),
                ExperimentTick("x.t", "x", 1, 0.5, 8, 16),  # torch rollout: no gap, no TIS
            ],
        )
    )
    text = m.render().decode()
    assert 'loraplex_engine_logprob_gap{experiment="x.v",namespace="x"} 0.0123' in text
    assert 'loraplex_engine_logprob_gap{experiment="x.t"' not in text
    assert 'loraplex_engine_tis_weight_mean{experiment="x.v",namespace="x"} 0.97' in text
    assert 'loraplex_engine_tis_weight_mean{experiment="x.t"' not in text
    m.forget("x.v")
    assert "x.v" not in m.render().decode()


def test_gaps_split_over_ranks_average_to_the_one_rank_gap() -> None:
    """Data parallel (issue 17): each rank totals its own rows' gaps and rank 0 averages
    the totals: the token-weighted mean of one rank, not a mean of the ranks' means."""
    rows = [
        TrainRow("a", 0, [1, 2], [3, 4, 5], [-1.0, -2.0, -3.0], 0.0, 1.0),
        TrainRow("a", 0, [1, 2], [3], [-0.5], 0.0, 1.0),
        TrainRow("b", 0, [1], [3, 4], [-1.0, -1.0], 0.0, 1.0),
    ]
    trainer = [torch.tensor([-1.5, -2.0, -2.0]), torch.tensor([-0.75]), torch.tensor([-1.25, -1.0])]
    one = logprob_gaps(rows, trainer)
    assert one == pytest.approx({"a": (0.5 + 0.0 + 1.0 + 0.25) / 4, "b": 0.25 / 2})
    ranks = [gap_totals(rows[:1], trainer[:1]), gap_totals(rows[1:], trainer[1:])]
    assert mean_gaps(ranks) == pytest.approx(one)
    assert mean_gaps([{}, {"a": (0.0, 0)}]) == {"a": 0.0}  # a rank with no tokens of it


def test_tis_totals_over_ranks_give_the_one_rank_mean_and_every_token() -> None:
    """Each rank totals the TIS weight over its share's tokens; combined, rank 0 reports
    the token-weighted mean of one rank and the tokens of all ranks. An experiment whose
    loss applied no TIS has none, whatever its gap."""
    one = {"a": (1.5 + 0.5 + 2.0 + 1.0, 4)}
    ranks = [StepTotals({"b": (0.5, 2)}, {"a": (1.5, 1)}), StepTotals({}, {"a": (3.5, 3)})]
    outcomes = {"a": TrainOutcome(), "b": TrainOutcome()}
    got = with_totals(outcomes, ranks)
    assert got["a"] == TrainOutcome(tis_weight_mean=5.0 / 4, tis_tokens=4)
    assert got["a"] == with_totals(outcomes, [StepTotals({}, one)])["a"]
    assert got["b"] == TrainOutcome(logprob_gap=0.25)  # no TIS: None and 0 tokens
    # a worker that trained without TIS adds no tokens: the count gives it away
    assert with_totals(outcomes, ranks[:1])["a"].tis_tokens == 1
    inf = TrainOutcome(logprob_gap=float("inf"), tis_weight_mean=float("nan"), tis_tokens=3)
    assert inf.finite() == TrainOutcome(tis_tokens=3)
