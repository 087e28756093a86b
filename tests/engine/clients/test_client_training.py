"""Models a client trains itself (clients/, spec/training_service.py) on a real Engine with the
tiny model: supervised learning end to end, fused ticks equal to training alone,
gradient accumulation, isolation from the engine's own experiments, saved states."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from loraplex_engine.clients.models import ClientModels
from loraplex_engine.clients.ops import Op
from loraplex_engine.spec.errors import NotFoundError
from loraplex_engine.spec.training_service import (
    AdamStep,
    ClientLora,
    ClientModelInfo,
    Forward,
    LossCall,
    OptimStep,
    SampleCall,
)

from tests.support.adapter_parity import adapter_gap, assert_same_training
from tests.support.client_driver import NS, drive, sft_datum
from tests.support.client_registry import enrolled, queue
from tests.support.engine_builders import engine, spec

PROMPT = [1, 40, 41, 42]
ANSWER = [100, 101, 102, 103]
OTHER = ([1, 50, 51], [200, 201, 202])
CE = LossCall("cross_entropy")
LR = 0.01


def _adapter(eng, model_id: str, ns: str = NS) -> dict[str, torch.Tensor]:
    model = eng.clients.loaded(ns, model_id)
    return eng.model.adapter_state_dict(model.name)


@pytest.fixture(scope="module")
def eng(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    e = engine(tiny_model_dir, tmp_path_factory.mktemp("clients"), max_adapters=6)
    yield e
    e.close()


def _unload_all(eng) -> None:
    for ns, model_id in list(eng.clients._models):
        drive(eng, lambda ns=ns, m=model_id: eng.clients.unload_model(ns, m))


def test_supervised_training_lowers_the_loss_and_the_sampler_emits_the_text(eng) -> None:
    eng.clients.create_model(NS, "sft", ClientLora(rank=8, seed=0))
    data = [sft_datum(PROMPT, ANSWER)]
    losses = []
    for _ in range(40):
        out, _ = drive(
            eng,
            lambda: eng.clients.forward_backward(NS, "sft", data, CE),
            lambda: eng.clients.optim_step(NS, "sft", AdamStep(learning_rate=0.005)),
        )
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < 0.1 * losses[0], losses
    # Sums over tokens: the loss is the weighted sum of -logprobs, per datum.
    row = out.outputs[0]
    assert row["logprobs"].shape == (len(PROMPT) + len(ANSWER) - 1,)
    np.testing.assert_allclose(row["elementwise_loss"].sum(), out.metrics["loss:sum"], rtol=1e-5)
    (saved,) = drive(eng, lambda: eng.clients.save_state(NS, "sft", "v1", "sampler_weights"))
    assert saved.path == "tinker://sft/sampler_weights/v1"
    call = SampleCall(PROMPT, num_samples=2, max_tokens=len(ANSWER), temperature=0.0)
    (got,) = drive(eng, lambda: eng.clients.sample(NS, saved.path, call))
    assert [r.token_ids for r in got.rows] == [ANSWER, ANSWER]
    # The base model does not say it.
    (base,) = drive(eng, lambda: eng.clients.sample(NS, eng.model_name, call))
    assert base.rows[0].token_ids != ANSWER
    assert eng.capacity().used_slots >= 1 and any("sft" in x for x in eng.capacity().experiments)
    _unload_all(eng)


def _train(eng, models: dict[str, list], steps: int, together: bool) -> None:
    """Each model's forward_backward + optim_step per step; ``together``: every model's
    calls queued before the tick (one fused pass), else one model at a time."""
    for _ in range(steps):
        groups = [list(models)] if together else [[m] for m in models]
        for group in groups:
            calls = []
            for m in group:
                calls.append(lambda m=m: eng.clients.forward_backward(NS, m, models[m], CE))
                calls.append(lambda m=m: eng.clients.optim_step(NS, m, AdamStep(learning_rate=LR)))
            drive(eng, *calls)


def test_two_models_of_different_ranks_in_one_tick_train_as_alone(eng) -> None:
    data = {"r4": [sft_datum(PROMPT, ANSWER)], "r8": [sft_datum(*OTHER), sft_datum(*OTHER)]}
    ranks = {"r4": 4, "r8": 8}
    adapters = {}
    for together in (False, True):
        for m, r in ranks.items():
            eng.clients.create_model(NS, m, ClientLora(rank=r, seed=3))
        _train(eng, data, 3, together)
        adapters[together] = {m: _adapter(eng, m) for m in ranks}
        _unload_all(eng)
    gaps = {m: adapter_gap(adapters[False][m], adapters[True][m], LR, 3) for m in ranks}
    assert_same_training(gaps)


def test_gradients_accumulate_until_optim_step(eng) -> None:
    d1, d2 = sft_datum(PROMPT, ANSWER), sft_datum(*OTHER)
    for m in ("split", "whole"):
        eng.clients.create_model(NS, m, ClientLora(rank=8, seed=5))
    for _ in range(3):
        drive(
            eng,
            lambda: eng.clients.forward_backward(NS, "split", [d1], CE),
            lambda: eng.clients.forward_backward(NS, "split", [d2], CE),
            lambda: eng.clients.optim_step(NS, "split", AdamStep(learning_rate=LR)),
            lambda: eng.clients.forward_backward(NS, "whole", [d1, d2], CE),
            lambda: eng.clients.optim_step(NS, "whole", AdamStep(learning_rate=LR)),
        )
    assert_same_training(
        {"acc": adapter_gap(_adapter(eng, "whole"), _adapter(eng, "split"), LR, 3)}
    )
    _unload_all(eng)


def test_an_experiment_training_between_calls_leaves_the_accumulated_gradient(eng) -> None:
    d1, d2 = sft_datum(PROMPT, ANSWER), sft_datum(*OTHER)
    for m in ("acc", "ref"):
        eng.clients.create_model(NS, m, ClientLora(rank=8, seed=7))
    drive(eng, lambda: eng.clients.forward_backward(NS, "acc", [d1], CE))
    held = [g.clone() for g in eng.clients.loaded(NS, "acc").grads]
    eng.put_experiment("default.rl", spec(steps=2, group=2, prompts=1), "default", "rl")
    while eng.get_experiment("default.rl").step < 2:  # the experiment zeroes and steps .grad
        eng.tick()
    assert all(
        torch.equal(a, b) for a, b in zip(held, eng.clients.loaded(NS, "acc").grads, strict=True)
    )
    eng.remove_experiment("default.rl")
    drive(
        eng,
        lambda: eng.clients.forward_backward(NS, "acc", [d2], CE),
        lambda: eng.clients.optim_step(NS, "acc", AdamStep(learning_rate=LR)),
        lambda: eng.clients.forward_backward(NS, "ref", [d1, d2], CE),
        lambda: eng.clients.optim_step(NS, "ref", AdamStep(learning_rate=LR)),
    )
    assert_same_training({"acc": adapter_gap(_adapter(eng, "ref"), _adapter(eng, "acc"), LR, 1)})
    _unload_all(eng)


def test_saved_weights_restore_the_same_loss(eng) -> None:
    data = [sft_datum(PROMPT, ANSWER), sft_datum(*OTHER)]
    eng.clients.create_model(NS, "orig", ClientLora(rank=4, seed=1, train_mlp=False))
    for _ in range(2):
        drive(
            eng,
            lambda: eng.clients.forward_backward(NS, "orig", data, CE),
            lambda: eng.clients.optim_step(NS, "orig", AdamStep(learning_rate=LR)),
        )
    (saved,) = drive(eng, lambda: eng.clients.save_state(NS, "orig", "ckpt", "weights"))
    assert saved.path in [s.path for s in eng.clients.list_saved(NS, "orig")]
    info = eng.clients.create_model_from_state(NS, "copy", saved.path, with_optimizer=True)
    assert info.lora.rank == 4 and not info.lora.train_mlp
    a, b = drive(
        eng,
        lambda: eng.clients.forward(NS, "orig", data, CE),
        lambda: eng.clients.forward(NS, "copy", data, CE),
    )
    assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-6)
    # Both step on from the same optimiser state: still the same.
    drive(
        eng,
        lambda: eng.clients.forward_backward(NS, "orig", data, CE),
        lambda: eng.clients.optim_step(NS, "orig", AdamStep(learning_rate=LR)),
        lambda: eng.clients.forward_backward(NS, "copy", data, CE),
        lambda: eng.clients.optim_step(NS, "copy", AdamStep(learning_rate=LR)),
    )
    gap = adapter_gap(_adapter(eng, "orig"), _adapter(eng, "copy"), LR, 3)
    assert gap.rms <= 1e-3 and gap.worst <= 2e-2, gap
    _unload_all(eng)


def test_a_sampler_keeps_its_published_version(eng) -> None:
    eng.clients.create_model(NS, "pub", ClientLora(rank=8, seed=2))
    data = [sft_datum(PROMPT, ANSWER)]
    call = SampleCall(PROMPT, max_tokens=4, temperature=0.0, prompt_logprobs=True)
    (v0,) = drive(eng, lambda: eng.clients.save_state(NS, "pub", "v0", "sampler_weights"))
    (before,) = drive(eng, lambda: eng.clients.sample(NS, v0.path, call))
    for _ in range(15):
        drive(
            eng,
            lambda: eng.clients.forward_backward(NS, "pub", data, CE),
            lambda: eng.clients.optim_step(NS, "pub", AdamStep(learning_rate=0.05)),
        )
    slots = len(eng.model.adapters())
    (after,) = drive(eng, lambda: eng.clients.sample(NS, v0.path, call))  # from a spare slot
    assert after.rows[0].token_ids == before.rows[0].token_ids
    assert after.prompt_logprobs == pytest.approx(before.prompt_logprobs)
    assert after.prompt_logprobs[0] is None and len(after.prompt_logprobs) == len(PROMPT)
    assert len(eng.model.adapters()) == slots  # the spare slot was freed
    _unload_all(eng)


def test_models_per_tick_takes_segments_in_turn() -> None:
    """``--client-models-per-tick N``: a tick takes at most N models' segments, starting
    with the models waited on longest; a model taken goes to the back of the line."""

    def taken(clients: ClientModels) -> list[str]:
        return [m.info.model_id for m, _ in clients.take().segments]

    for limit, ticks in (
        (None, [["a", "b", "c"], ["a", "b", "c"]]),
        (1, [["a"], ["b"], ["c"], ["a"], ["b"], ["c"]]),
        (2, [["a", "b"], ["c", "a"], ["b", "c"]]),
    ):
        infos = (ClientModelInfo(m, NS, "base", "tok", ClientLora(rank=4)) for m in "abc")
        clients, models = enrolled(infos, limit)
        for model in models:
            for _ in range(2):
                queue(clients, model, Op("forward_backward"), Op("optim_step"))
        assert [taken(clients) for _ in ticks] == ticks, limit
        assert not clients.has_work()
    queue(clients, models[0], Op("forward"), Op("forward"), Op("optim_step"))
    (segment,) = [ops for _, ops in clients.take().segments]  # a whole segment: one model's
    assert [op.kind for op in segment] == ["forward", "forward", "optim_step"]


def test_submitted_calls_run_in_their_order_not_their_arrival(eng) -> None:
    """``submit`` queues at once (its caller goes on) on the model's one queue, which
    orders the calls no tick has taken by their ``order`` (the SDK's seq_id): an
    optim_step (3) and a forward (4) that arrive before the forward_backward (2) still
    step its gradient, in one tick with it, and see the stepped weights. A call refused
    at once raises and queues nothing."""
    eng.clients.create_model(NS, "seq", ClientLora(rank=4, seed=1))
    data = [sft_datum(PROMPT, ANSWER)]
    (before,) = drive(eng, lambda: eng.clients.forward(NS, "seq", data, CE))
    step = eng.clients.submit(NS, "seq", OptimStep(AdamStep(learning_rate=0.05)), order=3)
    after = eng.clients.submit(NS, "seq", Forward(data, CE), order=4)
    grad = eng.clients.submit(NS, "seq", Forward(data, CE, backward=True), order=2)
    plain = eng.clients.submit(NS, "seq", Forward(data, CE))  # no order: after the numbered
    model = eng.clients.loaded(NS, "seq")
    assert list(model.queue) == [grad, step, after, plain]
    with pytest.raises(NotFoundError):
        eng.clients.submit(NS, "nobody", OptimStep(AdamStep()), order=1)
    ticks = 0
    while not plain.done.is_set():
        ticks += eng.tick() is not None
    loss = before.metrics["loss:sum"]
    assert grad.wait().metrics["loss:sum"] == pytest.approx(loss)
    assert step.wait()["learning_rate:mean"] == 0.05
    assert after.wait().metrics["loss:sum"] < 0.9 * loss  # stepped before it ran
    assert ticks == 2  # forward_backward + optim_step, then both forwards
    _unload_all(eng)
