"""The pure half of operator/loraplex_operator/aibrix.py: settings from the chart's
environment, ModelAdapter names and manifests (the live behaviour is test_aibrix_e2e.py)."""

from __future__ import annotations

import pytest
from loraplex_operator.aibrix import (
    MAX_NAME,
    AibrixConfig,
    adapter_name,
    desired,
    specs,
)
from loraplex_operator.config import Config
from loraplex_operator.resources import Experiment


def _exp(name: str = "bot", uid: str = "u-1") -> Experiment:
    return Experiment.from_obj(
        {
            "apiVersion": "loraplex.dev/v1alpha1",
            "kind": "LoRAExperiment",
            "metadata": {"name": name, "namespace": "team-a", "uid": uid},
            "spec": {"enginePool": "p", "task": {"name": "arith"}},
        }
    )


def test_off_unless_the_chart_turns_it_on() -> None:
    assert Config.from_env({}).aibrix is None
    assert AibrixConfig.from_env({"LORAPLEX_AIBRIX": "false"}) is None
    cfg = Config.from_env(
        {
            "LORAPLEX_AIBRIX": "true",
            "LORAPLEX_AIBRIX_POD_SELECTOR": '{"app": "vllm"}',
            "LORAPLEX_AIBRIX_ARTIFACT_ROOT": "/mnt/ckpt/",
        }
    ).aibrix
    assert cfg == AibrixConfig(artifact_root="/mnt/ckpt", pod_selector={"app": "vllm"})


@pytest.mark.parametrize("selector", ["", "{}", "[1]"])
def test_on_without_a_pod_selector_fails_at_start(selector: str) -> None:
    env = {"LORAPLEX_AIBRIX": "1", "LORAPLEX_AIBRIX_POD_SELECTOR": selector}
    with pytest.raises(ValueError, match="LORAPLEX_AIBRIX_POD_SELECTOR"):
        AibrixConfig.from_env(env)


def test_names_are_dns_labels_and_distinct() -> None:
    assert adapter_name("bot", "stable") == "bot-stable"
    long = "x" * 60
    a, b = adapter_name(long, "stable"), adapter_name(long, "canary")
    assert len(a) <= MAX_NAME and len(b) <= MAX_NAME and a != b
    assert a == adapter_name(long, "stable")  # the same name every round


def test_one_modeladapter_per_alias_at_its_version() -> None:
    cfg = AibrixConfig(artifact_root="/ckpt", pod_selector={"app": "vllm"}, base_model="b")
    want = desired(_exp(), {"stable": "v3", "latest": "v9"}, cfg)
    assert sorted(want) == ["bot-latest", "bot-stable"]
    assert specs(want.values())["bot-stable"] == {
        "podSelector": {"matchLabels": {"app": "vllm"}},
        "artifactURL": "/ckpt/team-a/bot/_versions/v3",
        "baseModel": "b",
    }
    meta = want["bot-latest"]["metadata"]
    assert meta["namespace"] == "team-a" and meta["ownerReferences"][0]["uid"] == "u-1"
    assert (
        "baseModel" not in desired(_exp(), {"stable": "v1"}, AibrixConfig())["bot-stable"]["spec"]
    )
    assert desired(_exp(), {}, cfg) == {}
