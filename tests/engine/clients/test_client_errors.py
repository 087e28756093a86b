"""Client calls refused before they reach a tick, each naming its field; and namespaces
that see nothing of each other (NotFoundError, never another error)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from loraplex_engine.spec.errors import InvalidRequestError, NoCapacityError, NotFoundError
from loraplex_engine.spec.training_service import (
    AdamStep,
    ClientDatum,
    ClientLora,
    LossCall,
    SampleCall,
)

from tests.support.client_driver import NS, drive, sft_datum
from tests.support.engine_builders import engine

GOOD = sft_datum([1, 40, 41], [100, 101])
N = len(GOOD.input_ids)
CE = LossCall("cross_entropy")
IS = LossCall("importance_sampling")


@pytest.fixture(scope="module")
def eng(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    e = engine(
        tiny_model_dir, tmp_path_factory.mktemp("client-errors"), max_adapters=2, max_registered=2
    )  # full at two models: no paging
    e.clients.create_model(NS, "m", ClientLora(rank=4, seed=0))
    yield e
    e.close()


def _with(**inputs: object) -> ClientDatum:
    return ClientDatum(GOOD.input_ids, {**GOOD.loss_inputs, **inputs})


def _without(key: str) -> ClientDatum:
    return ClientDatum(GOOD.input_ids, {k: v for k, v in GOOD.loss_inputs.items() if k != key})


@pytest.mark.parametrize(
    "data,loss,field",
    [
        ([], CE, "data"),
        ([ClientDatum([], {})], CE, "data[0].model_input"),
        ([ClientDatum([1, 99999], {})], CE, "data[0].model_input"),
        ([ClientDatum([1] * 600, {})], CE, "data[0].model_input"),  # context 512
        ([GOOD, _without("target_tokens")], CE, "data[1].loss_fn_inputs.target_tokens"),
        ([_with(target_tokens=np.array([1, 2]))], CE, "data[0].loss_fn_inputs.target_tokens"),
        ([_with(target_tokens=np.full(N, 473))], CE, "data[0].loss_fn_inputs.target_tokens"),
        ([_with(weights=np.ones((N, 2)))], CE, "data[0].loss_fn_inputs.weights"),
        ([_with(weights=np.full(N, np.nan))], CE, "data[0].loss_fn_inputs.weights"),
        ([_with(mask=np.ones(N))], CE, "data[0].loss_fn_inputs.mask"),
        ([GOOD], IS, "data[0].loss_fn_inputs.logprobs"),
        ([_with(logprobs=np.zeros(N))], IS, "data[0].loss_fn_inputs.advantages"),
        ([GOOD], LossCall("reinforce"), "loss_fn"),  # type: ignore[arg-type]
        ([GOOD], LossCall("ppo", {"eps": 0.2}), "loss_fn_config.eps"),
        ([GOOD], LossCall("ppo", {"clip_low_threshold": 2.0}), "loss_fn_config.clip_low_threshold"),
    ],
)
def test_bad_data_names_its_field(eng, data, loss, field) -> None:
    with pytest.raises(InvalidRequestError) as e:
        eng.clients.forward_backward(NS, "m", data, loss)
    assert e.value.field == field, e.value


def test_bad_settings_name_their_field(eng) -> None:
    with pytest.raises(InvalidRequestError) as e:
        eng.clients.create_model(NS, "big", ClientLora(rank=64))
    assert e.value.field == "lora_config.rank"
    with pytest.raises(InvalidRequestError) as e:
        eng.clients.optim_step(NS, "m", AdamStep(beta1=1.5))
    assert e.value.field == "adam_params"
    with pytest.raises(InvalidRequestError) as e:
        eng.clients.load_state(NS, "m", "s3://elsewhere", with_optimizer=False)
    assert e.value.field == "path"
    with pytest.raises(InvalidRequestError) as e:
        eng.clients.sample(NS, eng.model_name, SampleCall([1, 1000]))
    assert e.value.field == "prompt"


def test_a_full_engine_has_no_capacity(eng) -> None:
    eng.clients.per_namespace = 2  # one namespace may fill it (--client-models-per-namespace)
    eng.clients.create_model(NS, "second", ClientLora(rank=4))
    with pytest.raises(NoCapacityError):
        eng.clients.create_model(NS, "third", ClientLora(rank=4))
    assert eng.capacity().used_slots == 2
    drive(eng, lambda: eng.clients.unload_model(NS, "second"))
    assert eng.capacity().used_slots == 1


def test_another_namespace_sees_nothing(eng) -> None:
    (saved,) = drive(eng, lambda: eng.clients.save_state(NS, "m", "mine", "sampler_weights"))
    (weights,) = drive(eng, lambda: eng.clients.save_state(NS, "m", "w", "weights"))
    other = "team-b"
    for call in (
        lambda: eng.clients.model_info(other, "m"),
        lambda: eng.clients.forward(other, "m", [GOOD], CE),
        lambda: eng.clients.optim_step(other, "m", AdamStep()),
        lambda: eng.clients.save_state(other, "m", "x", "weights"),
        lambda: eng.clients.unload_model(other, "m"),
        lambda: eng.clients.sample(other, saved.path, SampleCall([1, 2])),
        lambda: eng.clients.create_model_from_state(other, "stolen", weights.path, True),
    ):
        with pytest.raises(NotFoundError):
            call()
    assert eng.clients.list_models(other) == [] and eng.clients.list_saved(other) == []
    assert {s.path for s in eng.clients.list_saved(NS, "m")} >= {saved.path, weights.path}
    eng.clients.create_model(other, "own", ClientLora(rank=4))
    with pytest.raises(NotFoundError):  # a path of NS, loaded from team-b's model
        eng.clients.load_state(other, "own", weights.path, with_optimizer=True)
    drive(eng, lambda: eng.clients.unload_model(other, "own"))
