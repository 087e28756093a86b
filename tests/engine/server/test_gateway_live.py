"""loraplex-gateway (a real process) in front of two real engine processes: the official
openai client streams from namespace A's adapter through it, the official tinker SDK
trains and samples through it with A's key, B's key finds nothing of A's in either API,
a read-only key cannot train, a revoked key stops at once, and a stream whose engine is
killed mid-answer ends with an error event instead of hanging (issue 29).

The gateway reads its view (engines, keys) from ``--engines-file``: the same view
directory.py's KubeDirectory builds from EnginePools, engine pods and labelled Secrets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import tinker
from tinker import types

from tests.support.gateway_process import GatewayProcess
from tests.support.server_process import EngineServer, wait_until
from tests.support.server_specs import put_body, small_spec
from tests.support.tinker_clients import service_client, sft

pytestmark = pytest.mark.slow

KEY_A = "tml-team-a-train-0123456789"
KEY_A_RO = "tml-team-a-sample-0123456789"
KEY_B = "tml-team-b-train-0123456789"
KEY_GONE = "tml-team-a-revoked-01234567"
ADAPTER = "team-a.say-yes"


def view(engines: list[tuple[str, EngineServer]], keys: list[tuple[str, str, str]]) -> dict:
    return {
        "engines": [
            {"name": name, "pool": f"pool-{name}", "url": srv.url, "token": srv.token}
            for name, srv in engines
        ],
        "keys": [{"namespace": ns, "key": k, "role": role} for ns, k, role in keys],
    }


KEYS = [
    ("team-a", KEY_A, "train"),
    ("team-a", KEY_A_RO, "sample"),
    ("team-b", KEY_B, "train"),
    ("team-a", KEY_GONE, "train"),
]


@pytest.fixture(scope="module")
def engines(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[EngineServer]]:
    work = tmp_path_factory.mktemp("gw-engines")
    one = EngineServer(tiny_model_dir, work / "ckpt", max_adapters=3, workdir=work / "e1")
    two = EngineServer(tiny_model_dir, work / "ckpt", max_adapters=3, workdir=work / "e2")
    with one, two:
        with one.client() as api:
            r = api.put(f"/v1/experiments/{ADAPTER}", json=put_body(ADAPTER, small_spec()))
            assert r.status_code == 201, r.text
        yield [one, two]


@pytest.fixture(scope="module")
def gateway(
    engines: list[EngineServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    gw = GatewayProcess(
        tmp_path_factory.mktemp("gw"),
        view([("e1", engines[0]), ("e2", engines[1])], KEYS),
        "--stream-idle-seconds",
        "20",
    )
    gw.start()
    try:
        yield gw
    finally:
        gw.stop()


def oai(gw: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)


def service(gw: GatewayProcess, key: str = KEY_A) -> tinker.ServiceClient:
    return service_client(gw.url, key)


def test_the_openai_client_streams_from_as_adapter(gateway: GatewayProcess) -> None:
    client = oai(gateway, KEY_A)
    for model in ("say-yes", ADAPTER):
        chunks = list(
            client.completions.create(
                model=model, prompt="hello", max_tokens=8, temperature=0, stream=True
            )
        )
        assert chunks and chunks[-1].choices[0].finish_reason is not None
        assert all(c.model == ADAPTER for c in chunks)
    whole = client.completions.create(model="say-yes", prompt="hello", max_tokens=8, temperature=0)
    assert whole.model == ADAPTER and whole.usage.completion_tokens > 0  # (it trains on)
    assert [m.id for m in client.models.list()] == [ADAPTER]
    assert [m.id for m in oai(gateway, KEY_B).models.list()] == []


def test_bs_key_finds_none_of_as_models(gateway: GatewayProcess) -> None:
    b = oai(gateway, KEY_B)
    for model in ("say-yes", ADAPTER):
        with pytest.raises(openai.NotFoundError):
            b.completions.create(model=model, prompt="x", max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            b.models.retrieve(model)
    with pytest.raises(openai.AuthenticationError):
        oai(gateway, "tml-nobody-0123456789abcdef").models.list()


def test_tinker_trains_and_samples_through_the_gateway(gateway: GatewayProcess) -> None:
    client = service(gateway)
    caps = service(gateway).create_rest_client().get_server_capabilities().result()
    base = caps.supported_models[0].model_name
    tc = client.create_lora_training_client(base_model=base, rank=8, seed=0).result()
    data = [sft([1, 40, 41, 42], [100, 101, 102, 103])]
    losses = []
    for _ in range(40):
        out = tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.005)).result()
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < losses[0] * 0.1, losses
    path = tc.save_weights_for_sampler("gw").result().path
    sampler = client.create_sampling_client(model_path=path)
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
    res = sampler.sample(types.ModelInput.from_ints([1, 40, 41, 42]), 1, greedy).result()
    assert list(res.sequences[0].tokens) == [100, 101, 102, 103]
    runs = service(gateway).create_rest_client().list_training_runs().result()
    assert tc.model_id in [r.training_run_id for r in runs.training_runs]

    # B's key: A's model, sampler and futures answer 404 as if they did not exist
    http = httpx.Client(base_url=gateway.url + "/api/v1", headers={"X-API-Key": KEY_B})
    r = http.post("/get_info", json={"model_id": tc.model_id})
    assert r.status_code == 404, r.text
    r = http.post("/asample", json={"num_samples": 1, "prompt": {"chunks": []}, "model_path": path})
    assert r.status_code == 404, r.text
    b_runs = service(gateway, KEY_B).create_rest_client().list_training_runs().result()
    assert tc.model_id not in [r.training_run_id for r in b_runs.training_runs]

    # the read-only key may look but not train
    ro = httpx.Client(base_url=gateway.url + "/api/v1", headers={"X-API-Key": KEY_A_RO})
    assert ro.post("/get_info", json={"model_id": tc.model_id}).status_code == 200
    for route, body in (
        ("/optim_step", {"model_id": tc.model_id, "seq_id": 99, "adam_params": {}}),
        ("/forward_backward", b"\x0a\x10" + tc.model_id.encode()[:16]),
    ):
        kw: dict[str, Any] = {"json": body} if isinstance(body, dict) else {"content": body}
        assert ro.post(route, **kw).status_code == 403
    with pytest.raises(tinker.PermissionDeniedError):
        service(gateway, KEY_A_RO).create_lora_training_client(base_model=base, rank=4).result()
    client.close("success").result()  # saves and unloads: the slot is free again


def test_a_checkpoint_downloads_through_the_gateway_for_its_namespace_only(
    gateway: GatewayProcess, tmp_path: Path
) -> None:
    """``tinker checkpoint download`` with only the gateway's address: the signed URLs
    the SDK is given are the gateway's, and no other namespace gets or uses them."""
    client = service(gateway)
    base = client.create_rest_client().get_server_capabilities().result()
    tc = client.create_lora_training_client(
        base_model=base.supported_models[0].model_name, rank=8, seed=0
    ).result()
    tc.forward_backward([sft([1, 40, 41], [100, 101, 102])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.005)).result()
    state = tc.save_state("to-download").result().path
    env = {**os.environ, "TINKER_BASE_URL": gateway.url, "TINKER_API_KEY": KEY_A}
    cli = [sys.executable, "-m", "tinker.cli", "checkpoint", "download", state, "-o", str(tmp_path)]
    done = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (adapter,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert sorted(p.name for p in adapter.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 8

    ext = tc.save_weights_external("export").result().path
    urls = client.create_rest_client().get_external_weights_urls(ext).result().urls
    files = f"{gateway.url}/api/v1/external_weights_files/team-a/"
    assert all(u.startswith(files) for u in urls.values()), urls  # never the engine's
    url = urls["adapter_model.safetensors"]
    got = httpx.get(url, timeout=60)  # as the SDK fetches it: no key
    assert got.status_code == 200, got.text
    assert len(got.content) == int(got.headers["content-length"]) > 1000
    # B's key: A's run is not found to sign, and A's URL is refused carrying it
    with pytest.raises(tinker.NotFoundError):
        service(gateway, KEY_B).create_rest_client().get_external_weights_urls(ext).result()
    assert httpx.get(url, headers={"X-API-Key": KEY_B}).status_code == 404
    assert httpx.get(url.replace("/team-a/", "/team-b/")).status_code == 404  # B has no such run
    assert httpx.get(url[:-4] + "0000").status_code == 401  # the signature is the engine's
    client.close("success").result()


def test_a_revoked_key_stops_without_a_restart(
    gateway: GatewayProcess, engines: list[EngineServer]
) -> None:
    client = oai(gateway, KEY_GONE)
    assert [m.id for m in client.models.list()] == [ADAPTER]
    gateway.write(view([("e1", engines[0]), ("e2", engines[1])], KEYS[:3]))

    def refused() -> bool:
        try:
            client.models.list()
        except openai.AuthenticationError:
            return True
        return False

    wait_until(refused, timeout=10)


def test_a_stream_whose_engine_dies_ends_with_an_error_event(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    doomed = EngineServer(tiny_model_dir, tmp_path / "ckpt", max_adapters=2, workdir=tmp_path / "e")
    with doomed:
        with doomed.client() as api:
            body = put_body("team-a.doomed", small_spec())
            assert api.put("/v1/experiments/team-a.doomed", json=body).status_code == 201
        gw = GatewayProcess(tmp_path, view([("doomed", doomed)], KEYS[:1]))
        gw.start()
        try:
            stream = oai(gw, KEY_A).completions.create(
                model="doomed", prompt="hello", max_tokens=480, temperature=1.0, stream=True
            )
            got = 0
            t0 = time.monotonic()
            with pytest.raises(openai.APIError, match="lost mid-answer"):
                for _ in stream:
                    got += 1
                    if got == 1:
                        doomed.kill()
            assert got >= 1 and time.monotonic() - t0 < 15
            metrics = httpx.get(gw.url + "/metrics").text
            assert 'loraplex_gateway_upstream_errors_total{reason="reset"}' in metrics
            assert "loraplex_gateway_time_to_first_token_seconds_count" in metrics
        finally:
            gw.stop()
