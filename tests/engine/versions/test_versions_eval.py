"""Versions and spec.eval on a real engine (tiny model, torch rollout): a version carries
the scores of the eval of its own step and holds the adapter that eval scored; an eval
score gates `stable` (a version without one never becomes stable, and says why);
`onEvalImprovement` publishes after each eval that beats every published version; a
`requestToken` publishes one version once, across edits and a resumed engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from loraplex_engine.engine import Engine
from loraplex_engine.spec.eval_scores import EvalResult
from loraplex_engine.spec.experiment import parse_spec
from loraplex_engine.store.versions import VersionStore
from loraplex_engine.versions.policy import improves
from safetensors.torch import load_file

from tests.support.engine_builders import engine, spec

NS = "team"
LR = 0.02  # the greedy eval of target-token rises from 0.0 to 1.0 within ~8 steps at this


def _exp(publish: dict[str, Any], ev: dict[str, Any] | None = None, **kw: Any):
    extra = {} if ev is None else {"eval": ev}
    kw.setdefault("every", 1)  # a checkpoint every step: the adapters to compare with
    kw.setdefault("keep", 100)
    return spec(steps=0, lr=LR, publish=publish, **extra, **kw)


def _run(eng: Engine, exp_id: str, ticks: int) -> dict[int, EvalResult]:
    """Ticks; the evals the ticks reported, by the step of the adapter they scored."""
    evals: dict[int, EvalResult] = {}
    for _ in range(ticks):
        report = eng.tick()
        assert report is not None
        for t in report.experiments:
            assert t.failed_reason is None, t
            if t.id == exp_id and t.eval is not None:
                evals[t.eval.step] = t.eval
    return evals


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "adapter_model.safetensors")


@pytest.mark.parametrize("schedule", ["sync", "pipelined"])
def test_a_version_holds_its_steps_eval_and_the_adapter_it_scored(
    tiny_model_dir, tmp_path, schedule: str
) -> None:
    eng = engine(tiny_model_dir, tmp_path, schedule=schedule)
    try:
        exp_id, name = f"{NS}.scored", "scored"
        gate = {"score": "evalReward", "atLeast": -1.0}  # any eval score passes
        put = _exp({"everySteps": 2, "keep": 20, "promoteWhen": gate}, {"everySteps": 2})
        eng.put_experiment(exp_id, put, NS, name, run_id="r")
        # pipelined, one experiment: it generates in one tick and trains in the next
        evals = _run(eng, exp_id, 7 if schedule == "sync" else 14)
        store = VersionStore(tmp_path)
        listed = store.list(NS, name)
        assert listed == [1, 2, 3]  # steps 2, 4, 6: each waited for its eval
        run_dir = tmp_path / NS / name / "r"
        for n in listed:
            m = store.read(NS, name, n, verify=True)
            assert m.step == 2 * n and m.eval_step == m.step
            ev = evals[m.step]
            assert m.scores["evalReward"] == ev.reward
            assert m.scores["evalPassAtK"] == ev.pass_at_k
            assert m.gate_passed is True and m.gate_note is None
            # The adapter of the version is the one its eval scored (step s), not the
            # one the same tick's update made (s + 1).
            version = _weights(store.path(NS, name, n))
            at = _weights(run_dir / f"step-{m.step:08d}")
            after = _weights(run_dir / f"step-{m.step + 1:08d}")
            assert all(torch.equal(version[k], at[k]) for k in at)
            assert any(not torch.equal(version[k], after[k]) for k in at)
        assert eng.get_experiment(exp_id).aliases["stable"] == "v3"
    finally:
        eng.close()


def test_a_stale_pipelined_version_takes_the_eval_one_step_back(tiny_model_dir, tmp_path) -> None:
    """maxStaleness 1 (pipelined): the eval of step s is scored while s -> s + 1 trains;
    the version due at s is written at s + 1 with that eval, the latest before it."""
    eng = engine(tiny_model_dir, tmp_path, schedule="pipelined")
    try:
        put = _exp({"everySteps": 2, "keep": 50}, {"everySteps": 2}, every=100)
        body = put.model_dump(by_alias=True, mode="json", exclude_none=True)
        body["algorithm"]["maxStaleness"] = 1
        eng.put_experiment(f"{NS}.stale", parse_spec(body), NS, "stale")
        evals = _run(eng, f"{NS}.stale", 12)
        store = VersionStore(tmp_path)
        manifests = [store.read(NS, "stale", n) for n in store.list(NS, "stale")]
        assert len(manifests) >= 4
        for m in manifests:
            assert m.eval_step == m.step - 1 and m.eval_step % 2 == 0
        # a tick reports an eval with the step it trains, a tick after the version's
        reported = [m for m in manifests if m.eval_step in evals]
        assert len(reported) >= len(manifests) - 1
        assert all(m.scores["evalReward"] == evals[m.eval_step].reward for m in reported)
    finally:
        eng.close()


def test_a_version_without_its_eval_score_never_becomes_stable(tiny_model_dir, tmp_path) -> None:
    eng = engine(tiny_model_dir, tmp_path)
    try:
        exp_id, name = f"{NS}.ungated", "ungated"
        gate = {"score": "evalPassAtK", "atLeast": 0.0}  # every eval score passes
        put = _exp({"keep": 20, "promoteWhen": gate}, {"everySteps": 1}, every=100)
        eng.put_experiment(exp_id, put, NS, name)
        early = eng.publish_version(exp_id)  # step 0: no eval ran yet
        assert early.gate_passed is False and "evalPassAtK" not in early.scores
        assert early.gate_note is not None and "no evalPassAtK" in early.gate_note
        assert "never becomes stable" in early.gate_note
        status = eng.get_experiment(exp_id)
        assert "stable" not in status.aliases and status.versions[-1].gate_note == early.gate_note
        _run(eng, exp_id, 2)  # the evals of steps 0 and 1 are in
        later = eng.publish_version(exp_id)
        assert later.gate_passed is True and later.eval_step is not None
        assert eng.get_experiment(exp_id).aliases["stable"] == later.version
    finally:
        eng.close()


def _expected_publishes(evals: dict[int, EvalResult], every: int | None) -> list[int]:
    """The steps onEvalImprovement (evalReward) with everySteps publishes at: after each
    eval of a trained adapter that beats every published version, or on the step count."""
    best: float | None = None
    out = []
    for step in sorted(s for s in evals if s > 0):
        reward = evals[step].reward
        if (every is not None and step % every == 0) or improves(reward, best):
            out.append(step)
            best = reward if best is None else max(best, reward)
    return out


def test_publish_on_eval_improvement_alone_and_with_every_steps(tiny_model_dir, tmp_path) -> None:
    eng = engine(tiny_model_dir, tmp_path)
    try:
        for name, every in (("better", None), ("both", 4)):
            exp_id = f"{NS}.{name}"
            policy: dict[str, Any] = {"onEvalImprovement": "evalReward", "keep": 100}
            if every is not None:
                policy["everySteps"] = every
            eng.put_experiment(exp_id, _exp(policy, {"everySteps": 1}, every=100), NS, name)
            evals = _run(eng, exp_id, 12)
            store = VersionStore(tmp_path)
            manifests = [store.read(NS, name, n) for n in store.list(NS, name)]
            steps = [m.step for m in manifests]
            assert steps == _expected_publishes(evals, every), (name, evals)
            assert 0 not in steps  # never the untrained adapter
            assert all(m.eval_step == m.step for m in manifests)
            rising = [m.scores["evalReward"] for m in manifests if m.step % (every or 10**9)]
            assert rising == sorted(set(rising))  # each beat all before it
            eng.remove_experiment(exp_id)
            if every is None:
                # The greedy eval rises as the adapter learns (seed 0: 0.0 to step 4, then
                # 0.2, 0.29, 1.0 at steps 5-7): the rule was tried on real improvements.
                assert len(steps) >= 3
    finally:
        eng.close()


def test_a_request_token_publishes_once_across_edits_and_a_resume(tiny_model_dir, tmp_path) -> None:
    from loraplex_engine.spec.publish import PublishSpec

    exp_id, name = f"{NS}.asked", "asked"
    store = VersionStore(tmp_path)
    first = engine(tiny_model_dir, tmp_path)
    try:
        status, _ = first.put_experiment(
            exp_id, _exp({"requestToken": "r1"}, every=2), NS, name, run_id="run"
        )
        assert [v.request_token for v in status.versions] == ["r1"]  # published on placement
        assert status.publish_request_token == "r1"
        _run(first, exp_id, 3)
        same = PublishSpec.model_validate({"requestToken": "r1", "keep": 1})
        assert len(first.update_publish(exp_id, same).versions) == 1  # the same token: no-op
        again = first.update_publish(exp_id, PublishSpec.model_validate({"requestToken": "r2"}))
        assert [(v.version, v.request_token) for v in again.versions] == [
            ("v1", "r1"),
            ("v2", "r2"),
        ]
        assert again.versions[-1].step == 3
        # Retention may drop the token's version: the token is kept beside the versions.
        every = PublishSpec.model_validate({"requestToken": "r2", "everySteps": 1, "keep": 1})
        first.update_publish(exp_id, every)
        _run(first, exp_id, 2)
        tokens = [store.read(NS, name, n).request_token for n in store.list(NS, name)]
        assert tokens and set(tokens) == {None}  # r2's version is gone
    finally:
        first.close()  # as if killed
    resumed = engine(tiny_model_dir, tmp_path)
    try:
        put = _exp({"requestToken": "r2", "keep": 1}, every=2)
        status, created = resumed.put_experiment(exp_id, put, NS, name, run_id="run")
        assert created and status.publish_request_token == "r2"
        assert {v.request_token for v in status.versions} == {None}  # r2 not published again
        put = _exp({"requestToken": "r3", "keep": 1}, every=2)
        status, _ = resumed.put_experiment(exp_id, put, NS, name, run_id="run")  # in place
        assert [v.request_token for v in status.versions].count("r3") == 1
        assert status.versions[-1].request_token == "r3" and status.publish_request_token == "r3"
    finally:
        resumed.close()
