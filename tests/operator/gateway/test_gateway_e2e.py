"""Tinker models as experiments (issue 29 item 3), end to end: the operator and the
gateway as `helm template` renders them (the gateway's container: deployed_gateway.py),
the kmock API server, and engine processes the test kubelet runs from the Pods the
operator writes.

Namespace A's key creates a model with the official tinker SDK: it is a LoRAExperiment in
team-a (as `kubectl get loraexperiments` lists it), placed and bound by the operator,
trained and sampled through the gateway; B's key finds nothing of it; a read-only key
cannot train; the openai client streams from A's (task) experiment's adapter through the
gateway and B's key gets 404 for it. The engine is killed with a step sent: the client is
answered "paused" meanwhile (the SDK retries), the model resumes from its checkpoint on
the engine that takes it (which replays from the journal what the checkpoint lacks, or
answers from it what was done), and the client's loop finishes unchanged. Which of those
paths the kill hits depends on timing; test_client_journal.py pins each. The openai
client completes on the model's adapter by its experiment's name; a base model no pool
serves is refused at create_model; the base model alone samples on a gateway session; a
model idle past spec.client.idleSeconds is suspended with a checkpoint and resumed by its
next call; a module kind that would train a module the pool does not allow is refused.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import tinker
from loraplex_operator import idle
from loraplex_operator.api.pool import FAMILY_TARGET_MODULES
from loraplex_operator.gateway import experiments as gx
from loraplex_operator.kube import EXPERIMENTS, POOLS, SECRETS
from tinker import types

from tests.support.deployed_gateway import GatewayContainer, gateway_values, rendered_gateway
from tests.support.harness import Harness
from tests.support.tinker_clients import service_client, sft

pytestmark = pytest.mark.slow

KEY_A = "tml-team-a-train-0123456789"
KEY_A_RO = "tml-team-a-sample-0123456789"
KEY_B = "tml-team-b-train-0123456789"
KEYS = [("team-a", KEY_A, "train", "a"), ("team-a", KEY_A_RO, "sample", "a-ro")]
KEYS += [("team-b", KEY_B, "train", "b")]
PROMPT, ANSWER = [1, 40, 41, 42], [100, 101, 102, 103]


def _train(tc: Any, steps: int, kill_at: int = -1, kill: Any = None) -> list[float]:
    """The client's loop; at step ``kill_at`` ``kill`` runs with the step's forward_backward
    and optim_step sent and not yet answered."""
    losses = []
    for i in range(steps):
        fwd = tc.forward_backward([sft(PROMPT, ANSWER)], "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=0.005))
        if i == kill_at:
            time.sleep(0.5)  # the requests on their way (journalled, or sent again)
            kill()
        out = fwd.result()
        opt.result()
        losses.append(out.metrics["loss:sum"])
    return losses


async def _keys(h: Harness) -> None:
    assert h.kube is not None
    for ns, key, role, name in KEYS:
        labels = {"loraplex.dev/api-key": "true", "loraplex.dev/api-key-role": role}
        meta = {"name": f"key-{name}", "namespace": ns, "labels": labels}
        await h.kube.create(SECRETS, {"metadata": meta, "stringData": {"key": key}}, ns)


async def test_a_tinker_model_is_an_experiment_through_the_gateway(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    values = gateway_values()
    async with Harness(tmp_path, tiny_model_dir, chart_values=values) as h:
        pool = h.pool_obj("pool-gw", slots=3, max_rank=8, replicas=(1, 2))
        # lm_head allowed: the SDK's models train unembed too (the default allowlist has
        # no lm_head, and the gateway would grant train_unembed off: client_modules.py).
        pool["spec"]["allowedTargetModules"] = [*FAMILY_TARGET_MODULES, "lm_head"]
        await h.apply(pool)
        await _keys(h)

        async def engine_ready() -> bool:
            pods = await h.engine_pods("pool-gw")
            return any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for p in pods
                for c in (p.get("status") or {}).get("conditions") or []
            )

        await h.wait_for("an engine of pool-gw ready", engine_ready, timeout=180)
        pod, container = rendered_gateway(values)
        gw = GatewayContainer(pod, container, tmp_path / "kubeconfig", tmp_path)
        await asyncio.to_thread(gw.start)
        try:
            await _scenario(h, gw)
        except BaseException:
            print(gw.log_text()[-6000:])
            raise
        finally:
            gw.stop()
        # After everything B's key tried: no experiment was ever written in team-b.
        assert h.kube is not None
        assert await h.kube.list(EXPERIMENTS, "team-b") == []


def _api(gw: GatewayContainer, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=gw.url + "/api/v1", headers={"X-API-Key": key}, timeout=30)


async def _status_at(h: Harness, name: str, step: int) -> dict[str, Any]:
    async def there() -> dict[str, Any] | None:
        s = await h.status("team-a", name)
        return (
            s if s.get("step") == step and (s.get("checkpoint") or {}).get("step") == step else None
        )

    return await h.wait_for(f"{name} at step {step}, checkpointed", there, timeout=60)


def _stream(gw: GatewayContainer, key: str, model: str) -> list[Any]:
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
    stream = client.completions.create(
        model=model, prompt="hello", max_tokens=8, temperature=0, stream=True
    )
    return list(stream)


async def _openai(h: Harness, gw: GatewayContainer) -> None:
    """A's task experiment's adapter streams through the gateway to A's key only."""
    await h.apply(h.experiment_obj("say-yes", "pool-gw", max_steps=0, every=50))
    await h.wait_phase("team-a", "say-yes", "Running", timeout=120)
    chunks = await asyncio.to_thread(_stream, gw, KEY_A, "say-yes")
    assert chunks and chunks[-1].choices[0].finish_reason is not None
    assert all(c.model == "team-a.say-yes" for c in chunks)
    for model in ("say-yes", "team-a.say-yes"):
        with pytest.raises(openai.NotFoundError):
            await asyncio.to_thread(_stream, gw, KEY_B, model)


async def _scenario(h: Harness, gw: GatewayContainer) -> None:
    assert h.kube is not None
    await _openai(h, gw)
    client = service_client(gw.url, KEY_A)
    rest = client.create_rest_client()
    caps = await asyncio.to_thread(lambda: rest.get_server_capabilities().result())
    base = caps.supported_models[0].model_name
    # A base model no pool of A's serves: refused at create_model, naming both.
    with pytest.raises(tinker.NotFoundError) as refused:
        await asyncio.to_thread(
            lambda: client.create_lora_training_client(base_model="no-such", rank=4).result()
        )
    assert "'no-such'" in str(refused.value) and f"'{base}'" in str(refused.value)
    assert [o for o in await h.kube.list(EXPERIMENTS, "team-a") if "client" in o["spec"]] == []
    # Sampling the base model alone on the gateway's session (no engine holds the session).
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
    base_sampler = client.create_sampling_client(base_model=base)
    res = await asyncio.to_thread(
        lambda: base_sampler.sample(types.ModelInput.from_ints(PROMPT), 1, greedy).result()
    )
    assert len(res.sequences[0].tokens) == 4
    tc = await asyncio.to_thread(
        lambda: client.create_lora_training_client(base_model=base, rank=4, seed=0).result()
    )
    # It is a LoRAExperiment in A's namespace, placed and bound by the operator.
    listed = [o for o in await h.kube.list(EXPERIMENTS, "team-a") if "client" in o["spec"]]
    assert [o["spec"]["client"]["modelId"] for o in listed] == [tc.model_id]
    name = listed[0]["metadata"]["name"]
    status = await h.status("team-a", name)
    assert status["phase"] == "Running" and status["engine"]

    losses = await asyncio.to_thread(_train, tc, 10)
    assert losses[-1] < losses[0] * 0.5, losses
    await _status_at(h, name, 10)  # the operator's status follows the engine's
    # The openai client completes on the model's adapter by its experiment's name (as
    # /v1/models lists it); B's key finds nothing by that name.
    chunks = await asyncio.to_thread(_stream, gw, KEY_A, name)
    assert chunks and all(c.model == f"team-a.{name}" for c in chunks)
    with pytest.raises(openai.NotFoundError):
        await asyncio.to_thread(_stream, gw, KEY_B, name)

    # B's key: A's model is not there, in the Tinker API nor as an experiment of B's.
    # (Async clients: the API server the gateway reads runs on this test's event loop.)
    b = _api(gw, KEY_B)
    assert (await b.post("/get_info", json={"model_id": tc.model_id})).status_code == 404
    r = await b.post("/optim_step", json={"model_id": tc.model_id, "seq_id": 99})
    assert r.status_code == 404
    assert await h.kube.list(EXPERIMENTS, "team-b") == []
    # A read-only key may read but not train.
    ro = _api(gw, KEY_A_RO)
    assert (await ro.post("/get_info", json={"model_id": tc.model_id})).status_code == 200
    r = await ro.post("/optim_step", json={"model_id": tc.model_id, "seq_id": 99})
    assert r.status_code == 403
    with pytest.raises(tinker.PermissionDeniedError):
        await asyncio.to_thread(
            lambda: (
                service_client(gw.url, KEY_A_RO)
                .create_lora_training_client(base_model=base, rank=4)
                .result()
            )
        )

    # The engine dies mid-step (SIGKILL, its step sent and unanswered): the operator
    # re-places the experiment, the engine that takes it resumes the model from its last
    # checkpoint and replays the step from the journal; the SDK, answered "paused"
    # meanwhile, goes on unchanged and its loop finishes.
    victim = status["engine"]
    loop = asyncio.get_running_loop()

    def kill() -> None:
        asyncio.run_coroutine_threadsafe(h.kill_engine(victim), loop).result()

    more = await asyncio.to_thread(_train, tc, 10, 2, kill)
    after = await _status_at(h, name, 20)
    assert after["engine"] != victim and after.get("restarts", 0) >= 1
    assert more[0] < losses[0] * 0.5, (losses, more)  # it went on from where it was
    assert more[-1] <= more[0], more

    # Sampling from its saved weights, through the gateway.
    path = await asyncio.to_thread(lambda: tc.save_weights_for_sampler("gw").result().path)
    sampler = client.create_sampling_client(model_path=path)
    res = await asyncio.to_thread(
        lambda: sampler.sample(types.ModelInput.from_ints(PROMPT), 1, greedy).result()
    )
    assert len(res.sequences[0].tokens) == 4

    # unload_model (the protocol's; this SDK has no method for it) ends it: the experiment
    # is deleted, its saved states stay.
    a = _api(gw, KEY_A)
    fut = (await a.post("/unload_model", json={"model_id": tc.model_id})).json()["request_id"]
    done = await a.post("/retrieve_future", json={"request_id": fut})
    assert done.json().get("type") == "unload_model", done.text

    async def deleted() -> bool:
        return [o["metadata"]["name"] for o in await h.kube.list(EXPERIMENTS, "team-a")] == [
            "say-yes"
        ]

    await h.wait_for("the model's experiment deleted", deleted, timeout=60)
    await _modules_allowed(h, gw, client, base)
    await _idle(h, gw)


async def _modules_allowed(h: Harness, gw: GatewayContainer, client: Any, base: str) -> None:
    """The pool allows no o_proj for a while: a model whose attention would train it is
    refused by the gateway (create_model) and by the operator's admission (an experiment
    written by hand), each naming the kind and the module."""
    assert h.kube is not None
    pool = await h.kube.get(POOLS, "pool-gw")
    allowed = list(pool["spec"]["allowedTargetModules"])
    assert "o_proj" in allowed
    await h.kube.patch(POOLS, "pool-gw", {"spec": {"allowedTargetModules": [
        m for m in allowed if m != "o_proj"
    ]}})  # fmt: skip
    a, session, seq = _api(gw, KEY_A), "s" + "cd" * 10, iter(range(1000))
    lora = {"rank": 4, "train_unembed": False}

    async def create_answers(code: int) -> bool:
        """A create_model answered ``code`` (the gateway re-reads pools every second); one
        that answered otherwise is undone."""
        body = {"session_id": session, "model_seq_id": next(seq), "base_model": base}
        r = await a.post("/create_model", json={**body, "lora_config": lora})
        if r.status_code == 200:
            await h.kube.delete(EXPERIMENTS, f"tinker-{session}-{body['model_seq_id']}", "team-a")
        return r.status_code == code

    await h.wait_for("the gateway refuses attention without o_proj", lambda: create_answers(422))
    with pytest.raises(tinker.APIStatusError) as refused:
        await asyncio.to_thread(
            lambda: client.create_lora_training_client(base_model=base, rank=4).result()
        )
    assert "o_proj" in str(refused.value) and "train_attn" in str(refused.value)
    by_hand = gx.manifest("team-a", "pool-gw", {**body_of(session, 999), "lora_config": lora})
    await h.apply(by_hand)

    async def not_admitted() -> bool:
        s = (await h.get("team-a", by_hand["metadata"]["name"]) or {}).get("status") or {}
        return "spec.client.trainAttn" in str(s.get("message")) and "o_proj" in str(s)

    await h.wait_for("admission refuses it", not_admitted, timeout=60)
    await h.kube.delete(EXPERIMENTS, by_hand["metadata"]["name"], "team-a")
    await h.kube.patch(POOLS, "pool-gw", {"spec": {"allowedTargetModules": allowed}})
    await h.wait_for("the gateway takes models again", lambda: create_answers(200))


def body_of(session: str, seq: int) -> dict[str, Any]:
    return {"session_id": session, "model_seq_id": seq}


async def _idle(h: Harness, gw: GatewayContainer) -> None:
    """A model no call names for spec.client.idleSeconds is suspended with a checkpoint
    (the operator, from the engine's idleSeconds); a call answers paused and resumes it."""
    assert h.kube is not None
    session = "s" + "ab" * 10
    lora = {"rank": 4, "train_unembed": False}  # the pool allows no lm_head
    create = {"session_id": session, "model_seq_id": 0, "lora_config": lora}
    obj = gx.manifest("team-a", "pool-gw", create)
    obj["spec"]["client"]["idleSeconds"] = 2
    name, model_id = obj["metadata"]["name"], f"{session}:train:0"
    await h.apply(obj)

    async def suspended() -> dict[str, Any] | None:
        o = await h.get("team-a", name)
        phase = ((o or {}).get("status") or {}).get("phase")
        return o if o and o["spec"].get("suspend") and phase == "Suspended" else None

    o = await h.wait_for("the idle model suspended", suspended, timeout=120)
    assert idle.IDLE_ANNOTATION in o["metadata"]["annotations"]
    assert o["status"]["checkpoint"]["path"].startswith(f"tinker://{model_id}/weights/")
    assert "idleSeconds" in o["status"]["message"]
    a = _api(gw, KEY_A)
    r = await a.post("/get_info", json={"model_id": model_id})
    assert r.status_code == 503 and r.json()["queue_state"] == "paused_capacity", r.text

    async def answers() -> bool:  # (get_info queues nothing: it may be suspended again)
        r = await a.post("/get_info", json={"model_id": model_id})
        return r.status_code == 200

    await h.wait_for("the idle model resumed by its calls", answers, timeout=120)
    await h.kube.delete(EXPERIMENTS, name, "team-a")
