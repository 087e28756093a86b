"""The math-verify reward plug-in (workloads/math_reward.py): scoring right, wrong and
hostile completions, in this process and through its entry point in a real plug-in
worker (environments/worker.py, started by PluginHost as the engine starts it), found in the
engine's metadata as this tree declares it (the ``engine_site`` fixture)."""

from __future__ import annotations

from pathlib import Path

import pytest
from loraplex_engine.plugins import discovery
from loraplex_engine.plugins.host import PluginHost
from loraplex_engine.plugins.reward import PluginReward
from loraplex_engine.tasks.rewards import RewardItem
from loraplex_engine.workloads import math_reward
from loraplex_engine.workloads.math_reward import math_verify_reward, score_one

from tests.support.plugin_install import with_path

GOLD = "Tom has 2*9 = <<2*9=18>>18 apples.\n#### 18"
RIGHT = [
    "2*9 = 18\n#### 18",
    "So he has \\boxed{\\frac{36}{2}} apples.",
    "#### 18.0",
    "#### $18 apples",
    "He has 9 and then 18",  # the last number
]
WRONG = ["#### 19", "\\boxed{17}", "no number at all", "#### eighteen", ""]
# Model output a tenant controls: huge, or built to make a symbolic parser compute forever.
HOSTILE = [
    "x" * 5_000_000 + " 18",  # only the tail is read: scores as its last number
    "\\boxed{9^{9^{9^{9}}}}",
    "#### 10^{10^{10}}!",
    "#### 99**99999999",
    "\\boxed{" + "{" * 100_000,
    "#### 1e99999999",
]


def test_right_and_wrong_answers() -> None:
    assert [score_one(c, GOLD) for c in RIGHT] == [1.0] * len(RIGHT)
    assert [score_one(c, GOLD) for c in WRONG] == [0.0] * len(WRONG)
    assert score_one("#### 1,000", "1000") == 1.0  # a bare gold, GSM8K's thousands
    assert math_verify_reward(["p", "p"], ["#### 18", "#### 3"], answer=[GOLD, GOLD]) == [1, 0]


def test_hostile_completions_score_zero_or_their_last_number() -> None:
    assert [score_one(c, GOLD) for c in HOSTILE] == [1.0] + [0.0] * (len(HOSTILE) - 1)


def test_a_power_is_never_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(text: str) -> list:
        raise AssertionError(f"parsed {text!r}")

    monkeypatch.setattr(math_reward, "_parse", refuse)
    assert score_one("\\boxed{2^{2^{40}}}", GOLD) == 0.0
    assert score_one("#### 18", "2^{2^{40}}") == 0.0  # a hostile gold column too


def test_math_verify_own_timeout_bounds_what_the_filter_lets_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past the filter, math_verify's signal timeout (this is the main thread, as in the
    worker) ends a comparison that would run for ever: 0, not a hang."""
    monkeypatch.setattr(math_reward, "risky", lambda answer: False)
    assert score_one("\\boxed{9^{9^{9}}}", GOLD) == 0.0


@pytest.fixture()
def engine_env(engine_site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Child processes (the worker, the listing) see this tree's entry points."""
    monkeypatch.setenv("PYTHONPATH", with_path(engine_site)["PYTHONPATH"])


@pytest.mark.usefixtures("engine_env")
def test_the_engine_lists_it_as_an_installed_reward() -> None:
    found = discovery._list_in_child()
    assert "math-verify" in found.rewards, found


@pytest.mark.usefixtures("engine_env")
def test_it_scores_through_its_entry_point_in_a_plugin_worker() -> None:
    completions = [*RIGHT, *WRONG, *HOSTILE]
    items = [RewardItem(prompt="q", completion=c, answer=GOLD) for c in completions]
    # A hostile batch answers within the worker's bound, or PluginError fails this test.
    reward = PluginReward("math-verify", PluginHost("team-a.gsm8k", "reward:math-verify", 60.0))
    try:
        scores = reward.score(items)
    finally:
        reward.close()
    assert scores == [1.0] * len(RIGHT) + [0.0] * len(WRONG) + [1.0] + [0.0] * 5
