"""The engine's ticks and training passes on ``/metrics`` (``loraplex_engine_ticks_total``,
``loraplex_engine_train_passes_total``), counted on a real ``loraplex-engine serve
--tinker-keys`` while an experiment and an official-SDK client train at once."""

from __future__ import annotations

import re

import httpx
import pytest
from tinker import types

from tests.support.server_process import EngineServer, tinker_engine_fixture, wait_until
from tests.support.tenant_api import put, spec, status
from tests.support.tinker_clients import service_client, sft

pytestmark = pytest.mark.slow

KEY = "tml-team-a-0123456789abcdef"
STEPS = 8


server = tinker_engine_fixture("train-passes", {"team-a": KEY})


def counters(api: httpx.Client) -> tuple[float, float]:
    """(training ticks, training passes) so far."""
    text = api.get("/metrics").text
    ticks = re.search(r'^loraplex_engine_ticks_total\{kind="train"\} (\S+)$', text, re.M)
    passes = re.search(r"^loraplex_engine_train_passes_total (\S+)$", text, re.M)
    assert ticks and passes, text[:2000]
    return float(ticks.group(1)), float(passes.group(1))


def both_kinds_train(server: EngineServer) -> tuple[float, float]:
    """An experiment and a client model training together: the training ticks and
    passes that ran meanwhile."""
    with server.client() as api:
        assert put(api, "team-b.exp", spec()).status_code == 201
        wait_until(lambda: status(api, "team-b.exp")["step"] >= 2)
        client = service_client(server.url, KEY)
        base = client.get_server_capabilities().supported_models[0].model_name
        tc = client.create_lora_training_client(base_model=base, rank=4).result()
        ticks0, passes0 = counters(api)
        for _ in range(STEPS):
            fb = tc.forward_backward([sft([1, 40, 41], [100, 101, 102])], "cross_entropy")
            step = tc.optim_step(types.AdamParams(learning_rate=1e-3))
            fb.result()
            step.result()
        ticks1, passes1 = counters(api)
        assert api.delete("/v1/experiments/team-b.exp").status_code == 200
    return ticks1 - ticks0, passes1 - passes0


def test_ticks_and_training_passes_are_counted(server: EngineServer) -> None:
    ticks, passes = both_kinds_train(server)
    print(f"{ticks:.0f} training ticks, {passes:.0f} passes")
    assert ticks >= STEPS  # every client step took at least one tick
    assert passes >= STEPS  # the client's steps had one each


def test_a_tick_with_both_kinds_runs_one_pass(server: EngineServer) -> None:
    """The one fused step (train/riders.py): the experiment's rows and the client's data
    in one pass, so no more passes than training ticks (it was two a tick with both)."""
    ticks, passes = both_kinds_train(server)
    print(f"{ticks:.0f} training ticks, {passes:.0f} passes")
    assert STEPS <= passes <= ticks
