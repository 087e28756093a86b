"""The official tinker SDK, unchanged, against a real ``loraplex-engine serve --tinker-keys``
(issue 28's must-shows): supervised learning whose sampler then says the trained text, two
clients of different ranks at once, an RL loop with ``importance_sampling`` whose reward
rises, ``save_state`` → ``create_training_client_from_state`` at the same loss, and a key
of another namespace that can neither see nor sample the model.

One engine process for the module (the tiny model, torch rollout, 6 slots); each test
closes its SDK session, which saves and unloads its models (server/tinker/state.py), so the next
finds the slots free. (SDK 0.38 has no unload call of its own.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from tests.support.server_process import EngineServer
from tests.support.tinker_clients import service_client, sft

pytestmark = pytest.mark.slow

KEY_A = "tml-team-a-0123456789abcdef"
KEY_B = "tml-team-b-0123456789abcdef"
PROMPT = [1, 40, 41, 42]
ANSWER = [100, 101, 102, 103]
OTHER = ([1, 50, 51], [200, 201, 202])
GREEDY = types.SamplingParams(max_tokens=len(ANSWER), temperature=0.0)


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineServer]:
    work = tmp_path_factory.mktemp("tinker")
    keys = work / "keys.txt"
    keys.write_text(f"team-a {KEY_A}\nteam-b {KEY_B}\n")
    srv = EngineServer(
        tiny_model_dir, work / "ckpt", max_adapters=6, workdir=work,
        extra_args=["--tinker-keys", str(keys)],
    )  # fmt: skip
    with srv:
        yield srv


def service(server: EngineServer, key: str = KEY_A) -> tinker.ServiceClient:
    return service_client(server.url, key)


def base_model(client: tinker.ServiceClient) -> str:
    return client.get_server_capabilities().supported_models[0].model_name


def train(tc: tinker.TrainingClient, data: list[types.Datum], steps: int, lr: float) -> list[float]:
    losses = []
    for _ in range(steps):
        out = tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=lr)).result()
        losses.append(out.metrics["loss:sum"])
    return losses


def test_supervised_training_lowers_the_loss_and_its_sampler_says_the_text(server) -> None:
    client = service(server)
    tc = client.create_lora_training_client(base_model=base_model(client), rank=8, seed=0).result()
    losses = train(tc, [sft(PROMPT, ANSWER)], 40, 0.005)
    assert losses[-1] < 0.1 * losses[0], losses
    sampler = tc.save_weights_and_get_sampling_client().result()
    got = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, GREEDY).result()
    assert [s.tokens for s in got.sequences] == [ANSWER, ANSWER]
    base = client.create_sampling_client(base_model=base_model(client)).result()
    said = base.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY).result()
    assert said.sequences[0].tokens != ANSWER  # the base model does not say it
    client.close("success").result()


def test_two_clients_of_different_ranks_train_at_the_same_time(server) -> None:
    """Two SDK clients, ranks 4 and 16, each in its own thread: both learn their text
    (the engine fuses their pending calls; tests/engine/clients/test_client_training.py shows
    the fused update equals training alone)."""
    results: dict[int, list[float]] = {}
    clients: dict[int, tinker.TrainingClient] = {}
    sessions: list[tinker.ServiceClient] = []

    def run(rank: int, data: list[types.Datum]) -> None:
        client = service(server)
        clients[rank] = client.create_lora_training_client(
            base_model=base_model(client), rank=rank, seed=rank
        ).result()
        results[rank] = train(clients[rank], data, 30, 0.005)
        sessions.append(client)

    threads = [
        threading.Thread(target=run, args=(4, [sft(PROMPT, ANSWER)])),
        threading.Thread(target=run, args=(16, [sft(*OTHER)])),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert sorted(results) == [4, 16]
    for rank, losses in results.items():
        assert clients[rank].get_info().lora_rank == rank
        assert losses[-1] < 0.2 * losses[0], (rank, losses)
    for client in sessions:
        client.close("success").result()


RL_ROUNDS = 20
RL_RISE = 0.15


def test_an_rl_loop_with_importance_sampling_raises_its_reward(server) -> None:
    """sample → reward → advantages → forward_backward(importance_sampling) → optim_step,
    as tinker-cookbook's RL loops do; the reward is the share of sampled token ids that are
    even (about half at first). The mean reward of the last 4 rounds beats the first 4's
    by RL_RISE: 16 rows x up to 4 tokens a round, so a round's mean of a fair coin has a
    standard deviation of about 0.06 and four rounds' 0.03; the two means' difference
    (sd 0.044) passes 0.15 by chance with odds under 1 in 5000 (z 3.4), while training
    moves it well past that (printed)."""
    client = service(server)
    tc = client.create_lora_training_client(base_model=base_model(client), rank=8, seed=1).result()
    prompt = types.ModelInput.from_ints(PROMPT)
    params = types.SamplingParams(max_tokens=4, temperature=1.0)
    rewards = []
    for _ in range(RL_ROUNDS):
        sampler = tc.save_weights_and_get_sampling_client().result()
        got = sampler.sample(prompt, 16, params).result()
        scores = [float(np.mean([t % 2 == 0 for t in s.tokens])) for s in got.sequences]
        rewards.append(float(np.mean(scores)))
        data = []
        for seq, score in zip(got.sequences, scores, strict=True):
            full = PROMPT + list(seq.tokens)
            n_prompt = len(PROMPT) - 1
            advantage = score - rewards[-1]
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={
                        "target_tokens": np.array(full[1:], dtype=np.int64),
                        "logprobs": np.array([0.0] * n_prompt + list(seq.logprobs), np.float32),
                        "advantages": np.array(
                            [0.0] * n_prompt + [advantage] * len(seq.tokens), np.float32
                        ),
                    },
                )
            )
        tc.forward_backward(data, "importance_sampling").result()
        tc.optim_step(types.AdamParams(learning_rate=0.03)).result()
    print("rewards by round:", [round(r, 2) for r in rewards])
    assert np.mean(rewards[-4:]) > np.mean(rewards[:4]) + RL_RISE, rewards
    client.close("success").result()


def test_save_state_then_a_client_from_it_gives_the_same_loss(server) -> None:
    client = service(server)
    tc = client.create_lora_training_client(base_model=base_model(client), rank=4, seed=2).result()
    train(tc, [sft(PROMPT, ANSWER)], 3, 0.01)
    path = tc.save_state("ck").result().path
    fixed = [sft(*OTHER), sft(PROMPT, ANSWER)]
    want = tc.forward(fixed, "cross_entropy").result()
    again = client.create_training_client_from_state_with_optimizer(path).result()
    got = again.forward(fixed, "cross_entropy").result()
    # The same adapter weights in the same engine: the same forward, bit for bit.
    assert got.metrics["loss:sum"] == want.metrics["loss:sum"]
    # And the optimiser state came with it: one more identical step stays identical.
    for t in (tc, again):
        t.forward_backward(fixed, "cross_entropy").result()
        t.optim_step(types.AdamParams(learning_rate=0.01)).result()
    one = tc.forward(fixed, "cross_entropy").result().metrics["loss:sum"]
    two = again.forward(fixed, "cross_entropy").result().metrics["loss:sum"]
    assert one == pytest.approx(two, rel=1e-6)
    client.close("success").result()


def test_another_namespaces_key_can_neither_see_nor_sample_the_model(server) -> None:
    """Team-b's key gets "not found" for team-a's saved states and published sampler,
    worded as for paths that do not exist, and team-a's run is not in its listing."""
    client = service(server)
    tc = client.create_lora_training_client(base_model=base_model(client), rank=4, seed=3).result()
    published = tc.save_weights_for_sampler("pub").result().path
    saved = tc.save_state("mine").result().path
    other = service(server, KEY_B)
    with pytest.raises(tinker.RequestFailedError, match=r"not.found"):
        other.create_training_client_from_state(saved).result()
    with pytest.raises((tinker.RequestFailedError, tinker.NotFoundError), match=r"not.found"):
        sampler = other.create_sampling_client(model_path=published).result()
        sampler.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY).result()
    runs = tinker.RestClient(base_url=server.url, api_key=KEY_B).list_training_runs().result()
    assert tc.model_id not in [r.training_run_id for r in runs.training_runs]
    mine = tinker.RestClient(base_url=server.url, api_key=KEY_A).list_training_runs().result()
    assert tc.model_id in [r.training_run_id for r in mine.training_runs]
    other.close("success").result()
    client.close("success").result()
