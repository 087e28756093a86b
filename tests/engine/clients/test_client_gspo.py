"""The ``gspo`` loss in the one fused step (clients/, train/riders.py) on a real Engine with
the tiny model: a model's gspo call answers the same bits whether it shares its tick
with another model's cross-entropy call or runs alone, and its gradient trains."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from loraplex_engine.spec.training_service import (
    AdamStep,
    ClientDatum,
    ClientLora,
    LossCall,
)

from tests.support.client_driver import NS, drive, sft_datum
from tests.support.engine_builders import engine

PROMPT = [1, 40, 41, 42]
SAMPLED = [100, 101, 102, 103]
GSPO = LossCall("gspo")
CE = LossCall("cross_entropy")


@pytest.fixture(scope="module")
def eng(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    e = engine(tiny_model_dir, tmp_path_factory.mktemp("gspo"), max_adapters=4)
    yield e
    e.close()


def gspo_datum(sampling_lp: list[float], advantage: float) -> ClientDatum:
    ob = len(PROMPT) - 1
    seq = PROMPT + SAMPLED
    return ClientDatum(
        seq[:-1],
        {
            "target_tokens": np.array(seq[1:], np.int64),
            "logprobs": np.array([0.0] * ob + sampling_lp, np.float32),
            "advantages": np.array([0.0] * ob + [advantage] * len(SAMPLED), np.float32),
            "sequence_ratio_mask": np.array([0.0] * ob + [1.0] * len(SAMPLED), np.float32),
        },
    )


def test_gspo_fused_with_another_model_answers_as_alone(eng) -> None:
    data = [gspo_datum([-4.0, -4.1, -3.9, -4.2], 1.5), gspo_datum([-9.0, -9.5, -8.0, -9.2], -0.7)]
    other = [sft_datum([1, 50, 51], [200, 201, 202])]
    eng.clients.create_model(NS, "g", ClientLora(rank=4, seed=1))
    eng.clients.create_model(NS, "c", ClientLora(rank=8, seed=2))
    (alone,) = drive(eng, lambda: eng.clients.forward_backward(NS, "g", data, GSPO))
    fused, _ = drive(
        eng,
        lambda: eng.clients.forward_backward(NS, "g", data, GSPO),
        lambda: eng.clients.forward_backward(NS, "c", other, CE),
    )
    for a, f in zip(alone.outputs, fused.outputs, strict=True):
        assert np.array_equal(a["logprobs"], f["logprobs"])
        assert np.array_equal(a["elementwise_loss"], f["elementwise_loss"])
    assert alone.metrics == fused.metrics
    # The accumulated gradient (two calls) trains: the loss moves.
    drive(eng, lambda: eng.clients.optim_step(NS, "g", AdamStep(learning_rate=0.05)))
    (after,) = drive(eng, lambda: eng.clients.forward(NS, "g", data, GSPO))
    assert after.metrics["loss:sum"] != alone.metrics["loss:sum"]
