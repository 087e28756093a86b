"""The gateway's Tinker-models-as-experiments decisions (gateway/experiments.py): names,
the manifest a create_model becomes, where a model's calls go, the paused answers."""

from __future__ import annotations

from typing import Any

import pytest
from loraplex_engine.spec.experiment import parse_spec
from loraplex_operator.gateway import experiments as gx
from loraplex_operator.resources import Experiment

from tests.support.builders import experiment
from tests.support.crdkit import admit

SESSION = "s0123456789abcdef0123"
CREATE = {"session_id": SESSION, "model_seq_id": 2, "lora_config": {"rank": 8, "seed": 5}}


def test_names_round_trip_and_refuse_what_is_not_a_gateway_model() -> None:
    assert gx.experiment_name(f"{SESSION}:train:2") == f"tinker-{SESSION}-2"
    assert gx.model_id_of(f"tinker-{SESSION}-2") == f"{SESSION}:train:2"
    for bad in (None, "", f"{SESSION}:sample:2", "S0123456789ABCDEF0123:train:1", "x:train:1"):
        assert gx.experiment_name(bad) is None
    assert gx.model_id_of("my-experiment") is None


def test_the_manifest_is_a_valid_client_experiment_the_engine_parses() -> None:
    obj = gx.manifest("team-a", "pool-a", CREATE)
    assert obj["metadata"]["name"] == f"tinker-{SESSION}-2"
    assert obj["metadata"]["namespace"] == "team-a"
    assert obj["metadata"]["labels"][gx.SESSION_LABEL] == SESSION
    assert admit("LoRAExperiment", obj) == []  # the CRD's schema and CEL rules
    spec = parse_spec(obj["spec"])  # and the engine's own parser
    assert spec.client is not None and spec.task is None
    assert (spec.client.model_id, spec.client.seed, spec.lora.rank) == (
        f"{SESSION}:train:2",
        5,
        8,
    )
    assert spec.checkpoint.every_steps == 1 and spec.algorithm.max_steps == 0
    assert Experiment.from_obj(obj).spec.client  # the operator's view


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"session_id": "s1"}, "session_id"),
        ({"session_id": None}, "session_id"),
        ({"model_seq_id": "2"}, "model_seq_id"),
        ({"model_seq_id": True}, "model_seq_id"),
        ({"model_seq_id": -1}, "model_seq_id"),
        ({"lora_config": None}, "lora_config"),
        ({"lora_config": {"rank": 0}}, "lora_config.rank"),
        ({"lora_config": {"rank": "8"}}, "lora_config.rank"),
        ({"lora_config": {"rank": 8, "seed": 2**63}}, "lora_config.seed"),
        ({"lora_config": {"rank": 8, "train_mlp": "no"}}, "lora_config.train_mlp"),
    ],
)
def test_a_bad_create_model_names_its_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(gx.BadRequest) as info:
        gx.manifest("team-a", "pool-a", {**CREATE, **change})
    assert info.value.field == field


def test_module_kinds_carry_through() -> None:
    body = {**CREATE, "lora_config": {"rank": 4, "train_unembed": False}}
    client = gx.manifest("team-a", "pool-a", body)["spec"]["client"]
    assert client == {
        "modelId": f"{SESSION}:train:2",
        "trainAttn": True,
        "trainMlp": True,
        "trainUnembed": False,
    }


def _ready_false(message: str) -> dict[str, Any]:
    return {"type": "Ready", "status": "False", "reason": "Preempted", "message": message}


@pytest.mark.parametrize(
    ("status", "suspend", "expected"),
    [
        ({"phase": "Running", "engine": "pool-a-engine-x"}, False, ("running", "pool-a-engine-x")),
        ({"phase": "Running"}, False, ("paused", None)),  # no engine written yet
        ({"phase": "Scheduled", "engine": "pool-a-engine-x"}, False, ("paused", None)),
        (
            {"phase": "Pending", "conditions": [_ready_false("preempted by b")]},
            False,
            ("paused", None),
        ),
        ({}, False, ("paused", None)),
        ({"phase": "Suspended"}, True, ("paused", None)),
        (
            {"phase": "Failed", "conditions": [_ready_false("bad checkpoint")]},
            False,
            ("failed", None),
        ),
    ],
)
def test_binding(status: dict[str, Any], suspend: bool, expected: tuple[str, str | None]) -> None:
    obj = experiment("a").client().suspend(suspend).status(**status).obj()
    b = gx.binding(obj)
    assert (b.state, b.engine) == expected
    if b.state != "running":
        assert b.reason
    if status.get("conditions"):
        assert status["conditions"][0]["message"] in b.reason
    if suspend:
        assert "suspend" in b.reason


def test_paused_answers_carry_the_sdks_queue_state() -> None:
    fut = gx.paused_future("m~x~1", "the model is pending")
    assert fut == {
        "type": "try_again",
        "request_id": "m~x~1",
        "queue_state": "paused_capacity",
        "queue_state_reason": "the model is pending",
    }
    assert gx.paused_error("why")["queue_state"] == "paused_capacity"


def test_future_ids() -> None:
    name = f"tinker-{SESSION}-2"
    assert gx.split_future(gx.create_future(name)) == ("create", name, "")
    assert gx.split_future(gx.model_future(name, "r1")) == ("model", name, "r1")
    assert gx.created_answer(name) == {"model_id": f"{SESSION}:train:2", "type": "create_model"}
    for stage1 in ("pool-a-engine-x~r1", "lx~not-a-model", "m~" + name, "m~x~r1"):
        assert gx.split_future(stage1) is None


def test_base_model_names_and_why_one_is_not_served() -> None:
    assert gx.base_model_name("tiny-llama:v1") == "tiny-llama"
    assert gx.base_model_name(None) is None
    for bad in ("", ":tag", 7, ["tiny-llama"]):
        with pytest.raises(gx.BadRequest) as e:
            gx.base_model_name(bad)
        assert e.value.field == "base_model"
    why = gx.not_served("team-a", "Qwen3-8B", {"tiny-llama", None, "llama-2"})
    assert "'Qwen3-8B'" in why and "'team-a'" in why and "'llama-2', 'tiny-llama'" in why
    assert "serve nothing" in gx.not_served("team-a", "x", set())


def test_a_base_model_sampler_carries_its_session_and_model() -> None:
    sid = gx.base_sampler_id(SESSION, 3, "tiny-llama")
    assert sid == f"{SESSION}:sample:b3:tiny-llama"
    assert gx.split_base_sampler(sid) == (SESSION, "tiny-llama")
    minted = gx.base_sampler_id(SESSION, None, "tiny-llama")  # no seq id: a random tag
    assert minted != gx.base_sampler_id(SESSION, None, "tiny-llama")
    assert gx.split_base_sampler(minted) == (SESSION, "tiny-llama")
    assert gx.base_sampler_id(SESSION, 1, "a model/with space") is None  # no name to carry
    for other in (f"{SESSION}:sample:3", f"{SESSION}:train:0", None, 5, "x:sample:b1:m"):
        assert gx.split_base_sampler(other) is None
