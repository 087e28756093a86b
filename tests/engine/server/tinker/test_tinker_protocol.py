"""The Tinker protocol (/api/v1, loraplex_engine/server/tinker/) driven by the real, unchanged
tinker SDK against a real uvicorn server. The engine behind it is tinker_double.py's
FakeTraining, a TEST DOUBLE of TrainingService: it pins the wire layer's answers to exact
numbers a real engine cannot give. The same SDK against the real engine, in a real
``serve`` process: test_tinker_engine.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from tests.support.tinker_server import BASE, KEY_A, KEY_B, KEY_C, Server


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path)
    yield s
    s.stop()


def datum(tokens: list[int], weights_dtype: str = "float32") -> types.Datum:
    n = len(tokens)
    weights = np.ones(n, dtype=np.float32 if weights_dtype == "float32" else np.int64)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.array([*tokens[1:], 0])),
            "weights": types.TensorData.from_numpy(weights),
        },
    )


def test_a_training_loop_round_trips_through_the_sdk(server: Server) -> None:
    caps = server.rest().get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [BASE]
    client = server.client()
    tc = client.create_lora_training_client(base_model=BASE, rank=4).result()
    assert tc.get_info().lora_rank == 4
    assert tc.get_tokenizer().encode("hello world", add_special_tokens=False) == [1, 2]

    out = tc.forward_backward([datum([3, 4, 5]), datum([6, 7])], "cross_entropy").result()
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0] * 3, [-1.0] * 2]
    assert out.metrics["loss:sum"] == pytest.approx(5.0)
    step = tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert step.metrics == {"grad_norm": 2.0, "learning_rate": pytest.approx(1e-3)}
    fwd = tc.forward([datum([3, 4, 5])], "cross_entropy").result()
    assert fwd.loss_fn_outputs[0]["logprobs"].tolist() == pytest.approx([-1.1] * 3)

    path = tc.save_weights_for_sampler("s1").result().path
    assert path == f"tinker://{tc.model_id}/sampler_weights/s1"
    sampler = client.create_sampling_client(model_path=path).result()
    params = types.SamplingParams(max_tokens=3, temperature=0.5)
    res = sampler.sample(
        types.ModelInput.from_ints([5, 6, 7]),
        num_samples=2,
        sampling_params=params,
        include_prompt_logprobs=True,
        topk_prompt_logprobs=2,
    ).result()
    assert [s.tokens for s in res.sequences] == [[9, 10, 11], [10, 11, 12]]
    assert res.sequences[0].logprobs == [-0.25] * 3
    assert res.sequences[0].stop_reason == "length"
    assert res.prompt_logprobs == [None, -0.5, -0.5]
    top2 = [(0, -0.5), (1, -1.5)]
    assert res.topk_prompt_logprobs == [None, top2, top2]
    live = tc.save_weights_and_get_sampling_client().result()
    assert live.sample(types.ModelInput.from_ints([1]), 1, params).result().sequences

    state = tc.save_state("ck1").result().path
    assert state == f"tinker://{tc.model_id}/weights/ck1"
    runs = server.rest().list_training_runs().result()
    assert [r.training_run_id for r in runs.training_runs] == [tc.model_id]
    assert runs.training_runs[0].last_checkpoint.tinker_path == state
    listed = server.rest().list_checkpoints(tc.model_id).result().checkpoints
    ids = {c.checkpoint_id for c in listed}
    assert {"sampler_weights/s1", "weights/ck1"} <= ids

    tc2 = client.create_training_client_from_state_with_optimizer(state).result()
    fwd2 = tc2.forward([datum([3, 4])], "cross_entropy").result()
    assert fwd2.loss_fn_outputs[0]["logprobs"].tolist() == pytest.approx([-1.1] * 2)
    client.close("success").result()


def test_a_full_engine_pauses_creation_until_a_slot_frees(server: Server) -> None:
    client = server.client()
    first = client.create_lora_training_client(base_model=BASE, rank=2).result()
    client.create_lora_training_client(base_model=BASE, rank=2).result()  # 2 slots: full
    third = client.create_lora_training_client(base_model=BASE, rank=2)
    deadline = time.monotonic() + 10
    states: set[str] = set()
    while time.monotonic() < deadline and "paused_capacity" not in states:
        spaces = list(server.proto.futures._spaces.values())
        states = {f.state for space in spaces for f in list(space.values())}
        time.sleep(0.05)
    assert "paused_capacity" in states
    time.sleep(1.5)  # retried meanwhile, still paused, never an error
    with pytest.raises(TimeoutError):
        third.result(timeout=0.1)
    _unload(server, first)  # the SDK has no unload call: the protocol's own request
    assert third.result(timeout=20).get_info().lora_rank == 2


def _unload(server: Server, tc: tinker.TrainingClient) -> None:
    import httpx

    r = httpx.post(
        f"{server.url}/api/v1/unload_model",
        json={"model_id": tc.model_id},
        headers={"X-API-Key": KEY_A},
    )
    assert r.status_code == 200, r.text


def test_a_key_sees_only_its_namespace(server: Server) -> None:
    tc = server.client(KEY_A).create_lora_training_client(base_model=BASE, rank=2).result()
    path = tc.save_weights_for_sampler("mine").result().path
    other = server.rest(KEY_B)
    with pytest.raises(tinker.NotFoundError, match="training_run_id"):
        other.get_training_run(tc.model_id).result()
    assert other.list_training_runs().result().training_runs == []
    with pytest.raises(tinker.NotFoundError, match="model_path"):
        server.client(KEY_B).create_sampling_client(model_path=path).result()
    with pytest.raises(tinker.AuthenticationError):
        server.client(KEY_C).create_lora_training_client(base_model=BASE, rank=2).result()


def test_the_key_file_rotates_without_a_restart(server: Server) -> None:
    with pytest.raises(tinker.AuthenticationError):
        server.rest(KEY_C).list_training_runs().result()
    server.keys_file.write_text(f"team-c {KEY_C}\n")
    assert server.rest(KEY_C).list_training_runs().result().training_runs == []
    with pytest.raises(tinker.AuthenticationError):
        server.rest(KEY_A).list_training_runs().result()
    # One edit revokes C, adds B and mistypes a line: the bad line is skipped (logged),
    # the rest applies, the revocation included.
    server.keys_file.write_text(f"team-c not-a-key\nteam-b {KEY_B}\n")
    assert server.rest(KEY_B).list_training_runs().result().training_runs == []
    with pytest.raises(tinker.AuthenticationError):
        server.rest(KEY_C).list_training_runs().result()
    server.keys_file.unlink()  # unreadable: the last keys stay
    assert server.rest(KEY_B).list_training_runs().result().training_runs == []


def test_each_error_names_its_field(server: Server) -> None:
    client = server.client()
    tc = client.create_lora_training_client(base_model=BASE, rank=2).result()
    with pytest.raises(tinker.UnprocessableEntityError, match=r"data\[0\].loss_fn_inputs.weights"):
        tc.forward_backward([datum([1, 2], weights_dtype="int64")], "cross_entropy").result()
    bad_shape = datum([1, 2])
    bad_shape.loss_fn_inputs["weights"] = types.TensorData.from_numpy(np.ones(3, np.float32))
    tc2 = client.create_lora_training_client(base_model=BASE, rank=2).result()
    with pytest.raises(tinker.UnprocessableEntityError, match=r"weights.shape"):
        tc2.forward_backward([bad_shape], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match=r"lora_config.rank"):
        client.create_lora_training_client(base_model=BASE, rank=64).result()
    with pytest.raises(tinker.NotFoundError, match=r"base_model"):
        client.create_lora_training_client(base_model="other-model", rank=2).result()
    with pytest.raises(tinker.NotFoundError, match="training_run_id"):
        server.rest().get_training_run("nope:train:0").result()


def test_an_unknown_loss_and_model_answer_the_field(server: Server) -> None:
    import httpx
    from tinker.proto.request_conv import forward_backward_request_to_proto

    def post(model_id: str, loss: str) -> httpx.Response:
        req = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=[datum([1, 2])], loss_fn=loss),
            model_id=model_id,
            seq_id=1,
        )
        body = forward_backward_request_to_proto(req).SerializeToString()
        headers = {"X-API-Key": KEY_A, "Content-Type": "application/x-protobuf"}
        return httpx.post(f"{server.url}/api/v1/forward_backward", content=body, headers=headers)

    tc = server.client().create_lora_training_client(base_model=BASE, rank=2).result()
    r = post(tc.model_id, "custom")
    assert r.status_code == 422 and r.json()["error"]["field"] == "loss_fn"
    r = post("someone:train:9", "cross_entropy")
    assert r.status_code == 404 and r.json()["error"]["field"] == "model_id"
    admin = httpx.get(f"{server.url}/v1/experiments", headers={"X-API-Key": KEY_A})
    assert admin.status_code == 401  # a tenant key is no admin token


def test_a_vanished_client_has_its_models_saved_and_unloaded(server: Server) -> None:
    tc = server.client().create_lora_training_client(base_model=BASE, rank=2).result()
    server.proto.registry.session_ttl_s = 0.5  # below the SDK's 10 s heartbeat
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and ("unload_model", "team-a", tc.model_id) not in (
        server.training.log
    ):
        time.sleep(0.1)
    calls = [c for c, _, m in server.training.log if m == tc.model_id]
    saves = [c for c in calls if c.startswith("save_state:")]
    assert (
        saves == ["save_state:weights:loraplex-final"] and calls[-1] == "unload_model"
    )  # one copy
