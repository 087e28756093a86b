"""The one fused step (train/riders.py): in a tick where an experiment and a client model
both train, their rows run in one pass (one micro-batch plan, one forward and backward
each micro-batch), and the client's results are those of the client alone. A real Engine
with the tiny model (tests/support/engine_builders.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from loraplex_engine.spec.training_service import AdamStep, ClientLora, LossCall

from tests.support.client_driver import NS, drive, sft_datum
from tests.support.engine_builders import engine, spec

CE = LossCall("cross_entropy")
DATA = [sft_datum([1, 40, 41, 42], [100, 101, 102, 103]), sft_datum([1, 50, 51], [200, 201])]
STEPS = 3


@pytest.fixture(scope="module")
def eng(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    e = engine(tiny_model_dir, tmp_path_factory.mktemp("one-pass"), max_adapters=4)
    yield e
    e.close()


def client_run(eng) -> tuple[list[np.ndarray], dict[str, torch.Tensor], int, int]:
    """STEPS forward_backward + optim_step of a fresh client model: every step's per-token
    losses, its adapter after them, and the ticks and passes they took."""
    eng.clients.create_model(NS, "m", ClientLora(rank=4, seed=11))
    losses: list[np.ndarray] = []
    ticks, passes = eng._tick.count, eng.strategy.passes
    for _ in range(STEPS):
        out, _ = drive(
            eng,
            lambda: eng.clients.forward_backward(NS, "m", DATA, CE),
            lambda: eng.clients.optim_step(NS, "m", AdamStep(learning_rate=0.01)),
        )
        losses += [o["elementwise_loss"] for o in out.outputs]
    ticks, passes = eng._tick.count - ticks, eng.strategy.passes - passes
    model = eng.clients.loaded(NS, "m")
    adapter = {k: v.clone() for k, v in eng.model.adapter_state_dict(model.name).items()}
    drive(eng, lambda: eng.clients.unload_model(NS, "m", save=False))
    return losses, adapter, ticks, passes


def test_a_client_beside_an_experiment_trains_in_the_experiments_pass_as_alone(eng) -> None:
    alone, alone_adapter, ticks, passes = client_run(eng)
    assert passes == ticks  # alone: its own pass, one a tick
    eng.put_experiment("default.rl", spec(steps=0, group=2, prompts=2), "default", "rl")
    eng.tick()
    step = eng.get_experiment("default.rl").step
    beside, beside_adapter, ticks, passes = client_run(eng)
    assert eng.get_experiment("default.rl").step >= step + STEPS  # it trained meanwhile
    print(f"{ticks} ticks, {passes} passes with both kinds")
    assert passes == ticks  # one pass a tick, the experiment's and the client's together
    eng.remove_experiment("default.rl")
    for a, b in zip(alone, beside, strict=True):
        assert np.array_equal(a, b), (a, b)  # bit for bit
    for name, w in alone_adapter.items():
        assert torch.equal(w, beside_adapter[name]), name


def _grads(model, name: str) -> dict[str, torch.Tensor]:
    def grad(p: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(p) if p.grad is None else p.grad

    return {k: g.clone() for k, g in model.adapter_views(name, grad).items()}


def test_a_mixed_micro_batch_gives_each_kind_what_it_gets_alone(tiny_model_dir) -> None:
    """Experiment rows that share no prefix (adapter a) and a client call's data (adapter
    b, longer rows) in one micro-batch: one forward, one backward. Each adapter's
    gradient, and the call's per-token losses, match those of each kind's pass alone
    (only the padding width differs)."""
    from loraplex_engine.clients.inputs import Limits, check_data, check_loss
    from loraplex_engine.train.algorithms import ClippedRatioLoss
    from loraplex_engine.train.chunked_logprobs import HiddenStatesForward
    from loraplex_engine.train.riders import TrainCall
    from loraplex_engine.train.rows import TrainRow
    from loraplex_engine.train.step import fused_backward

    from tests.support.lora_helpers import multi_model

    model = multi_model(tiny_model_dir)
    forward = HiddenStatesForward(model, torch.device("cpu"))
    rows = [
        TrainRow("a", model.slot_of("a"), [1, 5 + i, 7], [9, 10 + i], [-1.0, -1.2], 0.5 - i, 1.0)
        for i in range(3)
    ]
    losses = {"a": ClippedRatioLoss()}
    loss = check_loss(CE)
    data = check_data(
        [sft_datum([1, 30, 31, 32, 33], [60, 61, 62, 63])], loss, Limits(256, None, 10**6)
    )

    def call() -> TrainCall:
        return TrainCall(model.slot_of("b"), data, loss, True)

    def run(with_rows: bool, riders: list[TrainCall]) -> dict[str, dict[str, torch.Tensor]]:
        for p in model.parameters():
            p.grad = None
        stats = fused_backward(forward, rows if with_rows else [], losses if with_rows else {},
                               0, 4096, riders=riders)  # fmt: skip
        assert stats.micro_batches == 1
        return {n: _grads(model, n) for n in ("a", "b")}

    alone_call, together_call = call(), call()
    exp_alone = run(True, [])["a"]
    call_alone = run(False, [alone_call])["b"]
    together = run(True, [together_call])
    for name, want in (("a", exp_alone), ("b", call_alone)):
        for key, g in want.items():
            assert torch.allclose(together[name][key], g, rtol=1e-5, atol=1e-7), (name, key)
    got, want = together_call.outputs[0], alone_call.outputs[0]
    assert np.allclose(got["elementwise_loss"], want["elementwise_loss"], rtol=1e-6, atol=1e-7)
