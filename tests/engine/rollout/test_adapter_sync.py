"""Adapter weight sync to the vLLM sampler: which transport the backend takes, its
fallback, and where each tick's measured sync is reported (tick report, status, metrics,
summary, progress).

The transports themselves run against real vLLM in test_vllm_backend.py (in memory ==
directory == peft) and test_vllm_requests.py (a real engine: only trained adapters are
sent, vLLM serves the new weights). Here a stand-in worker drives the policy a real
in-process worker never exercises: a vLLM whose loader cannot take tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loraplex_engine.local.runner import Progress, sync_line
from loraplex_engine.metrics import EngineMetrics
from loraplex_engine.rollout.vllm.engine_backend import VLLMRolloutBackend
from loraplex_engine.spec.api_types import AdapterSync, AdapterSyncStats, TickReport
from loraplex_engine.spec.errors import VLLMWorkerError
from safetensors.torch import load_file

CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}


class _Worker:
    """Answers the adapter calls like VLLMRollout; ``tensors``: whether its vLLM takes
    tensors (``refuse``: adapters whose every update vLLM refuses)."""

    def __init__(
        self, log: list[str], tensors: bool, refuse: set[str], die: set[str] = frozenset()
    ) -> None:
        self.log, self.refuse, self.die, self.alive = log, refuse, die, True
        self.info = {"device": "cuda", "lora_dtype": "bfloat16", "tensor_sync": True}
        self._tensors = tensors

    def load_adapter(self, name: str, path: Path) -> float:
        self.log.append(f"load {name} {load_file(path / 'adapter_model.safetensors')['w'].dtype}")
        return 0.0

    def update_adapter(self, name: str, path: Path) -> float:
        if name in self.refuse:
            raise VLLMWorkerError("update_adapter failed: ValueError: bad adapter")
        self.log.append(f"files {name}")
        return 0.0

    def update_adapter_tensors(self, name: str, config: dict, tensors: dict) -> dict:
        if not self._tensors:
            raise VLLMWorkerError(
                "update_adapter_tensors failed: TensorSyncUnavailable: vLLM's LoRA loader "
                "runs outside the worker process"
            )
        if name in self.refuse:
            raise VLLMWorkerError("update_adapter_tensors failed: ValueError: bad adapter")
        if name in self.die:
            self.alive = False
            raise VLLMWorkerError("vLLM worker exited with -9 during 'update_adapter_tensors'")
        assert config == CONFIG
        self.log.append(f"tensors {name} {tensors['w'].dtype}")
        return {"seconds": 0.0, "bytes": 8.0}

    def close(self, timeout: float = 30.0) -> None:
        self.alive = False


def _backend(
    log: list[str],
    *,
    tensors: bool = True,
    refuse: frozenset[str] = frozenset(),
    die: frozenset[str] = frozenset(),
):
    asked: list[torch.dtype] = []

    def export(exp_id: str, dtype: torch.dtype):
        asked.append(dtype)
        return dict(CONFIG), {"w": torch.ones(2, 2).to(dtype)}

    def start() -> _Worker:  # only the first worker dies
        log.append("start")
        return _Worker(log, tensors, set(refuse), set(die) if log.count("start") == 1 else set())

    return VLLMRolloutBackend("unused", export, {}, start=start), asked


def test_trained_adapters_go_in_memory_in_vllms_lora_dtype() -> None:
    log: list[str] = []
    backend, asked = _backend(log)
    for name in ("a", "b", "c"):
        backend.add_adapter(name)
    assert backend.transport == "tensors"
    result = backend.sync_adapters(["a", "c"])  # b was not trained: not sent
    assert log[4:] == ["tensors a torch.bfloat16", "tensors c torch.bfloat16"]
    assert log[1:4] == [f"load {n} torch.bfloat16" for n in "abc"]  # first loads: files
    assert set(asked) == {torch.bfloat16}
    assert result.refused == {}
    sync = result.sync
    assert sync is not None and sync.transport == "tensors"
    assert (sync.adapters, sync.bytes) == (2, 2 * 4 * 2)  # 2 adapters x 4 bf16 values
    assert sync.seconds >= 0.0
    assert backend.sync_adapters([]).sync is None  # nothing trained: nothing crosses


def test_a_vllm_that_takes_no_tensors_gets_files_from_then_on() -> None:
    log: list[str] = []
    backend, _ = _backend(log, tensors=False)
    backend.add_adapter("a")
    first = backend.sync_adapters(["a"])
    assert first.refused == {} and first.sync is not None and first.sync.transport == "files"
    assert backend.transport == "files"
    assert backend.sync_adapters(["a"]).sync.transport == "files"  # type: ignore[union-attr]
    assert log[2:] == ["files a", "files a"]


def test_an_adapter_vllm_refuses_fails_alone_and_keeps_the_transport() -> None:
    log: list[str] = []
    backend, _ = _backend(log, refuse=frozenset({"bad"}))
    backend.add_adapter("bad")
    backend.add_adapter("good")
    result = backend.sync_adapters(["bad", "good"])
    assert result.refused == {"bad": "update_adapter_tensors failed: ValueError: bad adapter"}
    assert backend.transport == "tensors"  # a bad adapter is no reason to leave memory
    assert result.sync is not None and result.sync.adapters == 1
    assert log[3:] == ["tensors good torch.bfloat16"]


def test_a_worker_that_dies_in_the_sync_is_restarted_with_every_adapter() -> None:
    log: list[str] = []
    backend, _ = _backend(log, die=frozenset({"a"}))
    backend.add_adapter("a")
    backend.add_adapter("b")
    result = backend.sync_adapters(["a", "b"])
    assert result.refused == {} and backend.restarts == 1
    # the restart's loads are the sync: both adapters at their current weights, as files
    assert log[3:] == ["start", "load a torch.bfloat16", "load b torch.bfloat16"]
    assert result.sync is not None
    assert (result.sync.adapters, result.sync.transport, result.sync.bytes) == (2, "files", 16)


# ---- where a tick's sync is reported ---------------------------------------------------


def _report(sync: AdapterSync | None) -> TickReport:
    return TickReport(seconds=0.1, phase_seconds={"sync": 0.01}, adapter_sync=sync)


SYNCS = [
    AdapterSync(seconds=0.002, adapters=2, bytes=4096, transport="tensors"),
    AdapterSync(seconds=0.004, adapters=1, bytes=2048, transport="tensors"),
]


def test_the_summary_and_progress_line_carry_each_ticks_sync() -> None:
    progress = Progress()
    assert progress.sync_summary() is None  # the torch rollout: no key in summary.json
    for sync in [*SYNCS, None]:
        progress.record(_report(sync))
    summary = progress.sync_summary()
    assert summary is not None
    assert summary["seconds_per_tick"] == [0.002, 0.004]
    assert summary["adapters_per_tick"] == [2, 1]
    assert summary["seconds_total"] == pytest.approx(0.006)
    assert summary["seconds_mean"] == pytest.approx(0.003)
    assert (summary["ticks"], summary["bytes_total"], summary["transports"]) == (
        2,
        6144,
        ["tensors"],
    )
    assert sync_line(SYNCS[1]) == "  adapter sync 4.0 ms/tick: 1 adapters, 0.00 MB as tensors"


def test_the_status_counts_syncs_and_keeps_the_last() -> None:
    stats = AdapterSyncStats()
    for sync in SYNCS:
        stats.record(sync)
    wire = stats.to_json()
    assert wire["syncs"] == 2 and wire["adaptersTotal"] == 3 and wire["bytesTotal"] == 6144
    assert wire["secondsTotal"] == pytest.approx(0.006)
    assert wire["last"] == {"seconds": 0.004, "adapters": 1, "bytes": 2048, "transport": "tensors"}


def test_the_sync_histogram_observes_ticks_that_sent_adapters() -> None:
    metrics = EngineMetrics()
    text = metrics.render().decode()
    for transport in ("tensors", "files"):  # both series from the first scrape, at 0
        assert f'loraplex_engine_adapter_sync_seconds_count{{transport="{transport}"}} 0.0' in text
    for sync in [*SYNCS, None]:
        metrics.observe_tick(_report(sync))
    text = metrics.render().decode()
    assert 'loraplex_engine_adapter_sync_seconds_count{transport="tensors"} 2.0' in text
    assert 'loraplex_engine_adapter_sync_seconds_sum{transport="tensors"} 0.006' in text
    assert 'loraplex_engine_adapter_sync_seconds_count{transport="files"} 0.0' in text


def test_the_shared_memory_segment_holds_the_tensors_or_is_not_made(monkeypatch) -> None:
    from loraplex_engine.rollout.vllm import backend as vllm_backend

    if not vllm_backend.SHM_DIR.is_dir():
        pytest.skip("no /dev/shm here: the pipe frame is the only in-memory way")
    tensors = {"a": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "b": torch.ones(4)}
    path = vllm_backend._shm_segment(tensors)
    assert path is not None and path.parent == vllm_backend.SHM_DIR
    try:
        back = load_file(path)
        assert back.keys() == tensors.keys()
        assert all(torch.equal(back[k], v) for k, v in tensors.items())
    finally:
        path.unlink()
    free = set(vllm_backend.SHM_DIR.glob("loraplex-sync-*"))
    monkeypatch.setattr(vllm_backend, "SHM_MARGIN_BYTES", 1 << 60)  # a full /dev/shm
    assert vllm_backend._shm_segment(tensors) is None  # then the pipe frame
    assert set(vllm_backend.SHM_DIR.glob("loraplex-sync-*")) == free  # nothing left
