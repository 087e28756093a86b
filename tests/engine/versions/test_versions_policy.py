"""When to publish, the gate, where aliases point, and version model names: the pure
decisions of versions/policy.py and versions/names.py."""

from __future__ import annotations

import math

import pytest
from loraplex_engine.spec.eval_scores import EvalResult
from loraplex_engine.spec.publish import PromoteWhen, PublishSpec
from loraplex_engine.versions import names
from loraplex_engine.versions.policy import (
    AliasMove,
    best_scores,
    due,
    gate,
    gate_note,
    improves,
    moves,
    next_aliases,
    scores_of,
    token_due,
)


def test_due_every_k_steps_only_with_a_policy() -> None:
    every3 = PublishSpec.model_validate({"everySteps": 3})
    assert [s for s in range(1, 10) if due(s, every3)] == [3, 6, 9]
    assert not due(3, PublishSpec()) and not due(3, None)


def test_scores_and_gate() -> None:
    assert scores_of([0.2, 0.4, math.nan]) == {"meanReward": pytest.approx(0.3)}
    assert scores_of([]) == {}
    at = PromoteWhen.model_validate({"atLeast": 0.3})
    assert gate({"meanReward": 0.3}, at) is True
    assert gate({"meanReward": 0.29}, at) is False
    assert gate({}, at) is False  # no score, no promotion
    assert gate({"meanReward": 0.9}, None) is None


def _eval(step: int, reward: float, pass_at_k: float) -> EvalResult:
    return EvalResult(step, reward, pass_at_k, k=1, samples=1, prompts=4, tokens=100)


def test_a_version_takes_the_eval_at_or_before_its_step() -> None:
    ev = _eval(10, 0.5, 0.25)
    assert scores_of([0.1], ev, step=10) == {
        "meanReward": pytest.approx(0.1), "evalReward": 0.5, "evalPassAtK": 0.25,
    }  # fmt: skip
    assert scores_of([0.1], ev, step=12)["evalReward"] == 0.5  # the latest before
    assert "evalReward" not in scores_of([0.1], ev, step=9)  # an eval of a later adapter
    assert "evalReward" not in scores_of([0.1], None, step=9)
    assert "evalPassAtK" not in scores_of([], _eval(0, 0.5, math.nan), step=1)


def test_the_gate_on_an_eval_score() -> None:
    at = PromoteWhen.model_validate({"score": "evalPassAtK", "atLeast": 0.5})
    scores = {"meanReward": 0.9, "evalReward": 0.9, "evalPassAtK": 0.4}
    assert gate(scores, at) is False  # the training reward does not count
    assert gate_note(scores, at) == "evalPassAtK 0.4 < promoteWhen.atLeast 0.5"
    assert gate({**scores, "evalPassAtK": 0.5}, at) is True
    assert gate_note({**scores, "evalPassAtK": 0.5}, at) is None
    # a version without an eval score never becomes stable, and says so
    assert gate({"meanReward": 0.9}, at) is False
    assert "no evalPassAtK" in str(gate_note({"meanReward": 0.9}, at))
    assert "never becomes stable" in str(gate_note({"meanReward": 0.9}, at))
    assert gate_note({}, None) is None


def test_eval_improvement_and_the_best_published() -> None:
    best = best_scores([{"evalReward": 0.3}, {"evalReward": 0.5, "meanReward": 0.1}, {}])
    assert best == {"evalReward": 0.5, "meanReward": 0.1}
    assert best_scores([{"evalReward": math.nan}]) == {}
    assert improves(0.51, best["evalReward"]) and not improves(0.5, best["evalReward"])
    assert improves(0.0, None)  # the first eval score beats none
    assert not improves(math.nan, None)


def test_a_request_token_publishes_once() -> None:
    spec = PublishSpec.model_validate({"requestToken": "release-7"})
    assert token_due(spec, None) == "release-7"
    assert token_due(spec, "release-6") == "release-7"
    assert token_due(spec, "release-7") is None  # applied: an edit or resume does not repeat it
    assert token_due(PublishSpec(), "release-7") is None and token_due(None, None) is None


def test_latest_follows_the_newest_and_the_gate_moves_stable() -> None:
    aliases, problems = next_aliases({}, {}, [1], set(), promoted=1)
    assert aliases == {"latest": 1, "stable": 1} and problems == []
    aliases, _ = next_aliases(aliases, {}, [1, 2], set(), promoted=None)  # v2 failed its gate
    assert aliases == {"latest": 2, "stable": 1}


def test_the_spec_holds_stable_and_owns_the_other_aliases() -> None:
    current = {"latest": 3, "stable": 3, "canary": 2}
    aliases, problems = next_aliases(current, {"stable": 1}, [1, 2, 3, 4], set(), promoted=4)
    assert aliases == {"latest": 4, "stable": 1} and problems == []  # canary left the spec
    # let go: stable stays where it is until the next passing version
    aliases, _ = next_aliases(aliases, {}, [1, 2, 3, 4], set())
    assert aliases["stable"] == 1


def test_hand_aliases_that_cannot_apply() -> None:
    current = {"latest": 3, "stable": 2, "canary": 2}
    hand = {"stable": 3, "canary": 9}
    aliases, problems = next_aliases(current, hand, [1, 2, 3], failed_gate={3})
    assert aliases == {"latest": 3, "stable": 2, "canary": 2}  # neither moved
    assert any("v3 failed its promotion gate" in p for p in problems)
    assert any("v9 is not a published version" in p for p in problems)


def test_aliases_to_pruned_versions_drop() -> None:
    aliases, _ = next_aliases({"latest": 1, "stable": 1}, {}, [4, 5], set())
    assert aliases == {"latest": 5}


def test_moves() -> None:
    assert moves({"latest": 1, "stable": 1}, {"latest": 2, "stable": 1, "canary": 2}) == [
        AliasMove("canary", None, 2),
        AliasMove("latest", 1, 2),
    ]


def test_version_names() -> None:
    v = names.parse("team-a.my.exp@v12")
    assert v is not None and (v.namespace, v.name, v.version, v.alias) == (
        "team-a",
        "my.exp",
        12,
        None,
    )
    a = names.parse("team-a.exp:stable")
    assert a is not None and (a.experiment, a.version, a.alias) == ("team-a.exp", None, "stable")
    for bad in (
        "team-a.exp", "exp@v1", "team-a.exp@v0", "team-a.exp@1", "team-a.exp:Stable",
        "team-a.exp:../x", "Team.exp@v1", "team-a.exp@v1:stable", "team-a./x@v1", "",
    ):  # fmt: skip
        assert names.parse(bad) is None, bad
    assert names.served_name("ns", "exp", 3) == "ns.exp@v3"
    assert names.untinkered("tinker://ns.exp:stable") == "ns.exp:stable"  # the SDK's scheme
    assert names.untinkered("tinker://model-1/weights/w") == "tinker://model-1/weights/w"
