"""Client experiments (clients/experiments.py, issue 29 item 3) on a real Engine with the
tiny model: a LoRAExperiment with spec.client is put like any experiment, trained by its
client's calls, checkpointed after each optimiser step before the step is answered,
adopted by the Tinker protocol under its model id, and resumed from its newest
checkpoint when it is put again (as on another engine after its pod died)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from loraplex_engine.clients import saved
from loraplex_engine.server.tinker.protocol import Protocol
from loraplex_engine.spec.errors import ConflictError, NotFoundError
from loraplex_engine.spec.experiment import parse_spec
from loraplex_engine.spec.service import PromptJob
from loraplex_engine.spec.training_service import AdamStep, LossCall

from tests.support.client_driver import drive, sft_datum
from tests.support.engine_builders import engine

NS = "team-a"
MODEL = "s0123456789abcdef0123:train:0"
NAME = "tinker-s0123456789abcdef0123-0"
EXP = f"{NS}.{NAME}"
CE = LossCall("cross_entropy")
DATA = [sft_datum([1, 40, 41, 42], [100, 101, 102, 103])]


def client_spec(keep: int = 2, **client: object):
    return parse_spec(
        {
            "lora": {"rank": 4},
            "client": {"modelId": MODEL, "seed": 1, **client},
            "algorithm": {"maxSteps": 0},
            "checkpoint": {"everySteps": 1, "keep": keep},
        }
    )


@pytest.fixture()
def eng(tiny_model_dir: Path, tmp_path: Path):
    e = engine(tiny_model_dir, tmp_path, max_adapters=3)
    yield e
    e.close()


def _step(eng) -> dict[str, float]:
    drive(eng, lambda: eng.clients.forward_backward(NS, MODEL, DATA, CE))
    return drive(eng, lambda: eng.clients.optim_step(NS, MODEL, AdamStep(learning_rate=0.01)))[0]


def _steps_on_disk(eng) -> list[str]:
    return [
        s.name for s in saved.list_saved(eng.store.root, NS, MODEL) if s.name.startswith("step-")
    ]


def _adapter(eng) -> dict[str, torch.Tensor]:
    model = eng.clients.loaded(NS, MODEL)
    return {k: v.detach().clone() for k, v in eng.model.adapter_state_dict(model.name).items()}


def test_put_train_checkpoint_remove_and_resume(eng) -> None:
    status, created = eng.put_experiment(EXP, client_spec(), NS, NAME)
    assert created and status.phase == "Running" and status.step == 0
    assert status.checkpoint is None and status.max_steps == 0
    assert eng.put_experiment(EXP, client_spec(), NS, NAME)[1] is False  # the same: 200
    with pytest.raises(ConflictError):
        eng.put_experiment(EXP, client_spec(trainMlp=False), NS, NAME)
    assert [s.id for s in eng.list_experiments()] == [EXP]

    for _ in range(3):
        _step(eng)
    status = eng.get_experiment(EXP)
    assert status.step == 3
    assert status.checkpoint is not None and status.checkpoint.step == 3
    assert status.checkpoint.path == f"tinker://{MODEL}/weights/step-00000003"
    assert _steps_on_disk(eng) == ["step-00000002", "step-00000003"]  # keep: 2
    trained = _adapter(eng)

    removed = drive(eng, lambda: eng.remove_experiment(EXP))[0]
    assert removed.checkpoint.step == 3  # already written after the step: not again
    assert eng.clients.loaded(NS, MODEL) is None and eng.list_experiments() == []
    with pytest.raises(NotFoundError):
        eng.get_experiment(EXP)

    status, created = eng.put_experiment(EXP, client_spec(), NS, NAME)
    assert created and status.step == 3 and status.checkpoint.step == 3
    resumed = _adapter(eng)
    assert trained.keys() == resumed.keys()
    assert all(torch.equal(trained[k], resumed[k]) for k in trained)
    _step(eng)  # and it trains on from there, optimiser state included
    assert eng.get_experiment(EXP).step == 4
    assert _steps_on_disk(eng) == ["step-00000003", "step-00000004"]


def test_a_removal_between_checkpoints_writes_one(eng) -> None:
    spec = parse_spec({**client_spec().to_json(), "checkpoint": {"everySteps": 5, "keep": 3}})
    eng.put_experiment(EXP, spec, NS, NAME)
    _step(eng)
    assert _steps_on_disk(eng) == []  # not due yet
    removed = drive(eng, lambda: eng.remove_experiment(EXP))[0]
    assert removed.checkpoint.step == 1 and _steps_on_disk(eng) == ["step-00000001"]


def test_the_tinker_protocol_adopts_the_model_in_its_namespace_only(eng) -> None:
    proto = Protocol(lambda: eng.clients)
    try:
        with pytest.raises(NotFoundError):
            proto.registry.model(NS, MODEL)  # not put yet
        eng.put_experiment(EXP, client_spec(), NS, NAME)
        with pytest.raises(NotFoundError):
            proto.registry.model("team-b", MODEL)
        model = proto.registry.model(NS, MODEL)
        assert (model.id, model.session_id, model.rank) == (MODEL, MODEL.split(":")[0], 4)
        proto.registry.session_ttl_s = 0.0  # no heartbeat ever comes: still kept
        assert proto.registry.expired() == []
        assert proto.registry.model(NS, MODEL) is model
    finally:
        proto.close()


def test_a_task_experiment_cannot_take_a_client_experiments_id(eng) -> None:
    from tests.support.engine_builders import spec

    eng.put_experiment(EXP, client_spec(), NS, NAME)
    with pytest.raises(ConflictError):
        eng.put_experiment(EXP, spec(), NS, NAME)


def test_a_model_its_client_unloaded_leaves_no_journal(eng) -> None:
    eng.put_experiment(EXP, client_spec(), NS, NAME)
    journal = eng.client_experiments.journal_dir(NS, MODEL)
    journal.mkdir(parents=True)
    (journal / "7.op").write_text("{}")
    drive(eng, lambda: eng.clients.unload_model(NS, MODEL))  # the client's unload_model
    assert eng.get_experiment(EXP).phase == "Succeeded"
    removed = eng.remove_experiment(EXP)  # the operator, once the gateway deleted it
    assert removed.phase == "Succeeded" and not journal.exists()
    assert eng.list_experiments() == []


def _complete(eng, model: str) -> list[int]:
    """A greedy completion of the datum's prompt, served by ticks driven here."""
    job = PromptJob(model=model, prompt_ids=[1, 40, 41, 42], max_tokens=1, temperature=0.0)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(eng.complete, job)
        deadline = time.monotonic() + 120
        while not answer.done() and time.monotonic() < deadline:
            if eng.tick() is None:
                time.sleep(0.001)
        return list(answer.result()[0].token_ids)


def test_openai_completions_by_the_experiment_id_run_on_its_client_adapter(eng) -> None:
    """The id /v1/models lists (<ns>.<name>) completes on the client model's adapter as
    trained so far: after training the prompt's next token, greedy decoding gives it, which
    the base does not."""
    eng.put_experiment(EXP, client_spec(), NS, NAME)
    target = [100]
    data = [sft_datum([1, 40, 41, 42], target)]
    assert _complete(eng, eng.model_name) != target  # else the test proves nothing
    for _ in range(20):
        drive(eng, lambda: eng.clients.forward_backward(NS, MODEL, data, CE))
        drive(eng, lambda: eng.clients.optim_step(NS, MODEL, AdamStep(learning_rate=0.05)))
    assert _complete(eng, EXP) == target
    assert _complete(eng, eng.model_name) != target  # the base is untouched
    with pytest.raises(NotFoundError):
        _complete(eng, f"{NS}.tinker-s0123456789abcdef0123-9")  # no such experiment


def test_the_status_says_how_long_its_client_has_been_idle(eng) -> None:
    """What the operator enforces spec.client.idleSeconds by: the time since the client's
    last call, counted from placement, 0 again after a call (the clock is moved back
    here instead of waiting)."""
    status, _ = eng.put_experiment(EXP, client_spec(), NS, NAME)
    assert status.idle_seconds is not None and 0 <= status.idle_seconds < 60
    assert status.to_json()["idleSeconds"] == status.idle_seconds
    eng.clients.loaded(NS, MODEL).last_call -= 1000
    assert eng.get_experiment(EXP).idle_seconds >= 1000
    _step(eng)
    assert eng.get_experiment(EXP).idle_seconds < 1000


@pytest.mark.parametrize("kinds", [{}, {"trainMlp": False}, {"trainAttn": False}])
def test_capacity_says_what_the_operator_needs_to_know_what_a_kind_trains(eng, kinds) -> None:
    """The operator and the gateway check a client experiment's module kinds against the
    pool's allowedTargetModules from the engine's targetModules (client_modules.py): the
    modules they compute are the ones this engine's adapter really targets."""
    from loraplex_operator import client_modules

    eng.put_experiment(EXP, client_spec(**kinds), NS, NAME)
    wrapped = eng.capacity().target_modules
    assert wrapped and set(wrapped) == set(eng.capacity().to_json()["targetModules"])
    trained = set(eng.model.config_of(eng.clients.loaded(NS, MODEL).name).target_modules)
    assert client_modules.refused(kinds, wrapped, sorted(trained)) == []
    for module in trained:  # allowing one fewer refuses the kind that trains it
        refused = client_modules.refused(kinds, wrapped, sorted(trained - {module}))
        assert [extra for *_, extra in refused] == [[module]]
