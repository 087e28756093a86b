"""Checkpoint lifetimes through the official SDK and CLI, against a real
``loraplex-engine serve --tinker-keys`` (tiny model, torch rollout, a checkpoint quota):

- ``save_weights_for_sampler`` every step leaves the volume as it was (sampler weights
  are held in memory, the newest few a model), and a sampler on a saved path samples
  exactly those weights after the model trained on; one pushed out says so;
- ``ttl_seconds`` is honoured: past it a sampler path answers "expired" and a
  ``save_state`` directory is gone;
- ``delete_checkpoint`` removes the caller's checkpoints (freeing its quota), and
  another namespace's delete of the same path is not found;
- a session's end writes one copy of its model's weights, not two;
- ``tinker checkpoint download`` fetches a PEFT adapter that ``peft`` loads, and whose
  logits on the tiny model are the engine's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from loraplex_engine.store.quota import tree_bytes
from tinker import types

from tests.support.server_process import EngineServer
from tests.support.tinker_clients import close_all, service_client, sft

pytestmark = pytest.mark.slow

KEY_A = "tml-team-a-0123456789abcdef"
KEY_B = "tml-team-b-0123456789abcdef"
KEY_C = "tml-team-c-0123456789abcdef"
RANK = 8
PER_MODEL = 4  # sampler weights kept a model (clients/sampler_cache.PER_MODEL)
PROMPT = [1, 40, 41, 42, 43]
DATA = [sft(PROMPT, [100, 101, 102])]
LOGPROBS = types.SamplingParams(max_tokens=1, temperature=0.0)
# A namespace's checkpoint quota: a handful of the tiny model's rank-8 weights states.
QUOTA = 3_000_000
# A sample call refused: at once (an HTTP error) or in its future.
REFUSED = (tinker.APIStatusError, tinker.RequestFailedError)


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineServer]:
    work = tmp_path_factory.mktemp("tinker-checkpoints")
    keys = work / "keys.txt"
    keys.write_text(f"team-a {KEY_A}\nteam-b {KEY_B}\nteam-c {KEY_C}\n")
    flags = ["--tinker-keys", str(keys), "--checkpoint-quota-bytes", str(QUOTA)]
    srv = EngineServer(
        tiny_model_dir, work / "ckpt", max_adapters=6, workdir=work, extra_args=flags
    )
    with srv:
        yield srv


@pytest.fixture(autouse=True)
def _closed_clients() -> Iterator[None]:
    yield
    close_all()


def _trainer(
    server: EngineServer, key: str = KEY_A
) -> tuple[tinker.ServiceClient, tinker.TrainingClient]:
    client = service_client(server.url, key)
    base = client.get_server_capabilities().supported_models[0].model_name
    return client, client.create_lora_training_client(base_model=base, rank=RANK, seed=1).result()


def _step(tc: tinker.TrainingClient) -> None:
    tc.forward_backward(DATA, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.05)).result()


def _logprobs(sampler: tinker.SamplingClient) -> list[float]:
    out = sampler.sample(
        types.ModelInput.from_ints(PROMPT), 1, LOGPROBS, include_prompt_logprobs=True
    )
    return [x for x in out.result().prompt_logprobs if x is not None]


def _namespace_bytes(server: EngineServer, ns: str = "team-a") -> int:
    return tree_bytes(server.checkpoint_root / ns)


def _model_dir(server: EngineServer, model_id: str, ns: str = "team-a") -> Path:
    return server.checkpoint_root / ns / "_tinker" / model_id


def test_sampler_saves_leave_the_volume_as_it_was_and_sample_their_weights(server) -> None:
    client, tc = _trainer(server)
    before = _namespace_bytes(server)
    steps = PER_MODEL + 4
    paths, seen = [], []
    for i in range(steps):
        _step(tc)
        paths.append(tc.save_weights_for_sampler(f"step-{i}").result().path)
        seen.append(_logprobs(client.create_sampling_client(model_path=paths[-1])))
    grown = _namespace_bytes(server) - before
    print(f"\nbytes on the volume after {steps} save_weights_for_sampler: {grown} "
          f"({grown / steps:.0f} a step)")  # fmt: skip
    assert grown == 0, f"{steps} sampler saves wrote {grown} bytes to the volume"
    _step(tc)  # the live adapter moves on: the newest path still samples its own weights
    again = _logprobs(client.create_sampling_client(model_path=paths[-1]))
    np.testing.assert_allclose(again, seen[-1], rtol=1e-5, atol=1e-6)
    assert not np.allclose(seen[0], seen[-1], atol=1e-3), "training moved nothing"
    listed = {
        c.tinker_path
        for c in client.create_rest_client().list_checkpoints(tc.model_id).result().checkpoints
    }
    assert set(paths[-PER_MODEL:]) <= listed and paths[0] not in listed
    with pytest.raises(REFUSED, match="pushed out by newer ones"):
        _logprobs(client.create_sampling_client(model_path=paths[0]))


def test_ttl_seconds_expire_sampler_weights_and_saved_states(server) -> None:
    client, tc = _trainer(server)
    _step(tc)
    short = tc.save_weights_for_sampler("short", ttl_seconds=2).result().path
    kept = tc.save_weights_for_sampler("kept", ttl_seconds=3600).result().path
    state = tc.save_state("short-state", ttl_seconds=2).result().path
    sampler = client.create_sampling_client(model_path=short)
    assert _logprobs(sampler)
    rest = client.create_rest_client()
    expiry = {
        c.tinker_path: c.expires_at for c in rest.list_checkpoints(tc.model_id).result().checkpoints
    }
    assert None not in (expiry[short], expiry[kept], expiry[state]), expiry
    time.sleep(2.5)
    with pytest.raises(REFUSED, match="expired"):
        _logprobs(sampler)
    listed = {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert short not in listed and state not in listed and kept in listed
    assert not (_model_dir(server, tc.model_id) / "weights" / "short-state").exists()
    assert _logprobs(client.create_sampling_client(model_path=kept))


def test_delete_frees_the_quota_and_another_namespace_cannot(server) -> None:
    client, tc = _trainer(server, KEY_C)  # its own namespace: the others' saves take none
    rest, other = (
        client.create_rest_client(),
        service_client(server.url, KEY_B).create_rest_client(),
    )
    sampler_path = tc.save_weights_for_sampler("to-delete").result().path
    saved: list[str] = []
    with pytest.raises(tinker.RequestFailedError, match="over its quota"):
        for i in range(QUOTA // 100_000):  # a rank-8 state of the tiny model: ~250 kB
            saved.append(tc.save_state(f"w{i}").result().path)
    assert len(saved) >= 2, saved
    for path in (saved[0], sampler_path):  # team-b's delete of team-c's path: not found
        with pytest.raises(tinker.NotFoundError):
            other.delete_checkpoint_from_tinker_path(path).result()
    listed = {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert set(saved) | {sampler_path} <= listed
    for path in (saved[0], sampler_path):
        rest.delete_checkpoint_from_tinker_path(path).result()
    listed = {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed.isdisjoint({saved[0], sampler_path}) and set(saved[1:]) <= listed
    assert tc.save_state("again").result().path  # the delete made room
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint_from_tinker_path(saved[0]).result()
    with pytest.raises(REFUSED, match="deleted"):
        _logprobs(client.create_sampling_client(model_path=sampler_path))


def test_a_session_end_writes_one_copy_of_the_weights(server) -> None:
    client, tc = _trainer(server)
    _step(tc)
    client.close("success").result(timeout=30)
    weights = _model_dir(server, tc.model_id) / "weights"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(weights.glob("*/client_state.json")):
        time.sleep(0.2)
    time.sleep(1.0)  # a second copy, if any, is written right after the first
    copies = sorted(p.parent.name for p in weights.glob("*/client_state.json"))
    assert len(copies) == 1, copies


def _engine_prompt_logprobs(client: tinker.ServiceClient, tc: tinker.TrainingClient) -> list[float]:
    path = tc.save_weights_for_sampler("compare").result().path
    return _logprobs(client.create_sampling_client(model_path=path))


def test_checkpoint_download_gives_a_peft_adapter_with_the_engines_logits(
    server, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    client, tc = _trainer(server)
    for _ in range(3):
        _step(tc)
    engine = _engine_prompt_logprobs(client, tc)
    state = tc.save_state("to-download").result().path
    env = {**os.environ, "TINKER_BASE_URL": server.url, "TINKER_API_KEY": KEY_A}
    cli = [
        sys.executable,
        "-m",
        "tinker.cli",
        "checkpoint",
        "download",
        state,
        "--output",
        str(tmp_path),
    ]
    done = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (adapter,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert sorted(p.name for p in adapter.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        logits = peft_model(input_ids=torch.tensor([PROMPT])).logits[0].float()
    logp = logits[:-1].log_softmax(-1).gather(-1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    np.testing.assert_allclose(logp.tolist(), engine, rtol=1e-4, atol=1e-4)
    # The CLI deleted its temporary export; what is left is the two saves of this test.
    kinds = {
        c.checkpoint_type
        for c in client.create_rest_client().list_checkpoints(tc.model_id).result().checkpoints
    }
    assert "external" not in kinds


def test_bad_ttls_foreign_paths_and_forged_urls_are_refused(server) -> None:
    import httpx

    client, tc = _trainer(server)
    api = httpx.Client(base_url=server.url + "/api/v1", headers={"X-API-Key": KEY_A}, timeout=60)
    r = api.post("/save_weights_for_sampler", json={"model_id": tc.model_id, "ttl_seconds": 0})
    assert r.status_code == 422 and "ttl_seconds" in r.text
    run = f"/training_runs/{tc.model_id}/checkpoints"
    assert api.put(f"{run}/weights/x/ttl", json={"ttl_seconds": -1}).status_code == 422
    assert api.delete(f"{run}/nonsense/x").status_code == 422
    path = tc.save_weights_external("export").result().path
    urls = client.create_rest_client().get_external_weights_urls(path).result().urls
    assert sorted(urls) == ["adapter_config.json", "adapter_model.safetensors"]
    url = urls["adapter_model.safetensors"]
    assert httpx.get(url).status_code == 200
    assert httpx.get(url.replace("team-a", "team-b")).status_code == 401  # signed for team-a
    assert httpx.get(url[:-4] + "0000").status_code == 401
    other = httpx.Client(base_url=server.url + "/api/v1", headers={"X-API-Key": KEY_B})
    assert other.get(f"{run}/external_weights/export/external_weights_urls").status_code == 404
    r = api.post(
        "/save_weights_external",
        json={"model_id": tc.model_id, "path": "x", "age_encryption_recipients": ["age1x"]},
    )
    assert r.status_code == 422 and "age_encryption_recipients" in r.text
    client.create_rest_client().delete_checkpoint_from_tinker_path(path).result()
    assert httpx.get(url).status_code == 404  # deleted: its URLs find nothing
