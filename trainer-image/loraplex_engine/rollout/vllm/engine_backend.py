"""The vLLM rollout as the engine runs it: one LoRA per experiment in a vLLM worker
process, requests planned per prompt group, and the trained adapters' weights pushed
after each optimiser step. ``make`` builds it from the engine's parts (rollout/select.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from loraplex_engine.lora.precision import cuda_free_and_total, dtype_name
from loraplex_engine.rollout.backends import ExportFn, RolloutParts, SyncResult
from loraplex_engine.rollout.base import Completion, RolloutRequest
from loraplex_engine.rollout.vllm.backend import RequestError, VLLMRollout
from loraplex_engine.rollout.vllm.config import kv_bytes_per_token, vllm_engine_args
from loraplex_engine.rollout.vllm.requests import (
    RequestResult,
    VLLMRequest,
    by_group,
    failed,
    plan_requests,
    rows_from,
)
from loraplex_engine.spec.api_types import MAX_NEW_TOKENS, AdapterSync
from loraplex_engine.spec.errors import UsageError, VLLMWorkerError

log = logging.getLogger("loraplex_engine.rollout")
# Worker restarts one generate call may spend before it fails (and with it the tick).
MAX_RESTARTS = 2


class VLLMRolloutBackend:
    """vLLM with one LoRA per experiment.

    Weights: an adapter is first loaded from a PEFT directory (the worker's zero "base"
    adapter is made from the first one's files). After each optimiser step, each adapter
    trained in the tick is sent again, the others not (they did not change): its tensors
    cross the worker's pipe in memory where the worker takes them (``tensor_sync`` in its
    info; rollout/vllm/tensor_sync.py), else as one directory written to a temporary directory.
    Either way the tensors are in vLLM's LoRA dtype (bf16 where the engine's dtype is
    bf16), cast on the engine's device: vLLM would cast to it anyway, so both transports
    give vLLM the same weights. A worker that turns out not to take tensors switches the
    backend to files for good. ``sync_adapters`` measures each sync (``AdapterSync``).

    Requests (rollout/vllm/requests.py): one vLLM request per prompt of an experiment, with
    ``n`` = its rows of that prompt (``groupSize``), so vLLM computes the prompt once;
    every experiment's and served completion's requests go in one batch, each with its
    own sampling settings. Seeded where reproducibility is wanted (rollout/vllm/requests.py).
    The worker answers whole rows: no per-token reports to a row's sink, no cancelling.
    Log-probs come back for the sampling distribution (``processed_logprobs``), which is
    what the trainer recomputes for the PPO ratio.

    Containment: a request vLLM refuses fails the rows it answers (``Completion.error``:
    the tick fails that experiment alone). A worker that dies or fails a batch as a whole
    is restarted with every adapter re-loaded at its current weights, and each
    experiment's requests are then resent on their own, so one whose requests kill the
    worker fails alone; after ``MAX_RESTARTS`` restarts in one call the call fails.
    """

    name = "vllm"
    shares_trainer_weights = False  # its own copy of the adapters, its own kernels

    def __init__(
        self,
        model_dir: str | Path,
        export: ExportFn,
        options: dict[str, Any],
        *,
        ignore_eos: bool = False,
        eos_ids: Sequence[int] = (),
        start: Callable[[], VLLMRollout] | None = None,
    ) -> None:
        self._export = export
        self._ignore_eos = ignore_eos
        # Every EOS of the generation config stops a row, as in the torch rollout (vLLM
        # alone stops at the tokenizer's one EOS unless its generation config is read).
        self._stop_ids = [] if ignore_eos else list(eos_ids)
        self._dir = Path(tempfile.mkdtemp(prefix="loraplex-vllm-sync-"))
        # ``options``: the worker's settings, engine defaults merged with the user's
        # (rollout/vllm/config.py), each keyword once.
        self._options = {"logprobs_mode": "processed_logprobs", **options}
        self._adapters: list[str] = []  # loaded, in order: what a restart re-loads
        # How a worker starts (tests give a stand-in to drive the restart policy).
        self._start = start or (lambda: VLLMRollout(model_dir, **self._options))
        self.restarts = 0  # worker restarts since start
        self._vllm = self._start()
        # vLLM's CPU sampler draws a seed per row and step anyway (forward_cpu): a seeded
        # request costs one more small draw there, so every experiment row is seeded.
        self._seed_all = self._vllm.info.get("device") == "cpu"
        self._sleeps = bool(options.get("sleep_mode"))
        self._tensor_sync = bool(self._vllm.info.get("tensor_sync"))
        if not self._tensor_sync:
            log.info("vLLM adapters sync as files: %s", self._vllm.info.get("tensor_sync_why"))
        # vLLM's LoRA dtype (its model dtype unless set): what the adapters are sent in.
        self._wire_dtype = _torch_dtype(self._vllm.info.get("lora_dtype"))

    @property
    def sleeps(self) -> bool:
        """Sleep mode: vLLM steps aside while the trainer trains (no overlap then)."""
        return self._sleeps

    @property
    def transport(self) -> str:
        """How the next sync sends adapters: "tensors" (in memory) or "files"."""
        return "tensors" if self._tensor_sync else "files"

    @property
    def worker_info(self) -> dict[str, Any]:
        """What the worker reported at start: vLLM version, dtype, limits."""
        return self._vllm.info

    @property
    def worker(self) -> VLLMRollout:
        return self._vllm

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Completion]:
        plan = plan_requests(requests, seed_all=self._seed_all)
        return rows_from(plan, self._results(plan), len(requests))

    def _results(self, plan: list[VLLMRequest]) -> list[RequestResult]:
        self._ensure_worker()
        try:
            return self._send(plan)
        except VLLMWorkerError as e:
            cause = _one_line(e)
        log.warning("vLLM batch failed (%s): resending each experiment's requests", cause)
        results: list[RequestResult | None] = [None] * len(plan)
        budget, broken = MAX_RESTARTS, True
        for idx in by_group(plan).values():
            if broken:
                if budget == 0:
                    raise VLLMWorkerError(
                        f"the vLLM worker kept failing after {MAX_RESTARTS} restarts: {cause}"
                    )
                budget -= 1
                self._restart(cause)
            try:
                for i, result in zip(idx, self._send([plan[i] for i in idx]), strict=True):
                    results[i] = result
                broken = False
            except VLLMWorkerError as e:
                cause = _one_line(e)
                why = f"the vLLM worker failed on this experiment's requests: {cause}"
                for i in idx:
                    results[i] = failed(why)
                broken = True
        if broken and budget:  # leave a working worker for the next call
            with contextlib.suppress(VLLMWorkerError):  # else the next call restarts it
                self._restart(cause)
        return [r for r in results if r is not None]

    def _send(self, plan: Sequence[VLLMRequest]) -> list[RequestResult]:
        answers = self._vllm.generate_each(
            [req.wire() for req in plan],
            stop_token_ids=self._stop_ids,
            ignore_eos=self._ignore_eos,
        )
        return [
            failed(str(a)) if isinstance(a, RequestError) else RequestResult([_row(c) for c in a])
            for a in answers
        ]

    def add_adapter(self, exp_id: str) -> None:
        self._ensure_worker()
        self._vllm.load_adapter(exp_id, self._write(exp_id)[0])
        self._adapters.append(exp_id)

    def sync_adapters(self, exp_ids: Sequence[str]) -> SyncResult:
        """Push each adapter's new weights (the base model stays loaded in vLLM); the
        result names the experiments whose update vLLM refused, and measures the sync
        (None when ``exp_ids`` is empty: nothing crossed)."""
        if not exp_ids:
            return SyncResult()
        start = time.perf_counter()
        self._ensure_worker()
        refused: dict[str, str] = {}
        sent, nbytes, files = 0, 0, 0
        for exp_id in exp_ids:
            try:
                via, size = self._push(exp_id)
            except VLLMWorkerError as e:
                if self._vllm.alive:
                    refused[exp_id] = _one_line(e)
                    continue
                # A restart loads every adapter at its current weights: that is the sync.
                nbytes = self._restart(_one_line(e))
                sent = files = len(self._adapters)
                break
            sent, nbytes, files = sent + 1, nbytes + size, files + (via == "files")
        seconds = time.perf_counter() - start
        transport = "files" if files else "tensors"
        return SyncResult(
            refused, AdapterSync(seconds=seconds, adapters=sent, bytes=nbytes, transport=transport)
        )

    def _push(self, exp_id: str) -> tuple[str, int]:
        """One adapter's new weights into its slot; (transport, tensor bytes)."""
        config, tensors = self._export(exp_id, self._wire_dtype)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if self._tensor_sync:
            try:
                self._vllm.update_adapter_tensors(exp_id, config, tensors)
                return "tensors", size
            except VLLMWorkerError as e:
                if not (self._vllm.alive and "TensorSyncUnavailable" in str(e)):
                    raise
                self._tensor_sync = False
                log.warning("vLLM takes no adapter tensors here (%s): files from now", _one_line(e))
        path = self._dir / exp_id
        _write_peft(path, config, tensors)
        self._vllm.update_adapter(exp_id, path)
        return "files", size

    @contextmanager
    def training_phase(self) -> Iterator[None]:
        """Co-located with sleep mode: vLLM's weights go to host memory and its KV cache
        is dropped while the trainer trains, and come back before adapters sync."""
        if not self._sleeps:
            yield
            return
        self._vllm.sleep()
        try:
            yield
        finally:
            self._vllm.wake_up()

    def remove_adapter(self, exp_id: str) -> None:
        if exp_id in self._adapters:
            self._adapters.remove(exp_id)
        if self._vllm.alive:  # a dead worker forgets it anyway: a restart won't load it
            self._vllm.remove_adapter(exp_id)
        shutil.rmtree(self._dir / exp_id, ignore_errors=True)

    def close(self) -> None:
        self._vllm.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _ensure_worker(self) -> None:
        if not self._vllm.alive:
            self._restart("the worker is not running")

    def _restart(self, cause: str) -> int:
        """A fresh worker with every adapter re-loaded from the engine's weights (the
        trained ones: the engine's model is the source of truth). One that fails to
        load is left out: its experiment's requests then fail alone. Returns the tensor
        bytes loaded."""
        log.warning("restarting the vLLM worker (%s) with %d adapters", cause, len(self._adapters))
        self._vllm.close(timeout=5)
        self.restarts += 1
        self._vllm = self._start()
        self._tensor_sync = bool(self._vllm.info.get("tensor_sync"))
        loaded = 0
        for exp_id in list(self._adapters):
            try:
                path, size = self._write(exp_id)
                self._vllm.load_adapter(exp_id, path)
                loaded += size
            except VLLMWorkerError:
                log.warning("the restarted vLLM worker refused adapter %s", exp_id, exc_info=True)
                self._adapters.remove(exp_id)
        return loaded

    def _write(self, exp_id: str) -> tuple[Path, int]:
        """The adapter's current weights as a PEFT directory; (its path, tensor bytes)."""
        config, tensors = self._export(exp_id, self._wire_dtype)
        path = self._dir / exp_id
        _write_peft(path, config, tensors)
        return path, sum(t.numel() * t.element_size() for t in tensors.values())


def _write_peft(path: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """A PEFT directory vLLM reads (no fsync: it is read once, right away)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(config, sort_keys=True))
    save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})


def _torch_dtype(name: str | None) -> torch.dtype:
    """A dtype the worker names ("bfloat16"); float32 where it names none."""
    dtype = getattr(torch, name or "float32", None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _row(comp: Any) -> Completion:
    tops = None
    if comp.top_logprobs is not None:
        tops = [{int(t): lp for t, lp in step} for step in comp.top_logprobs]
    return Completion(
        token_ids=list(comp.token_ids),
        logprobs=list(comp.logprobs or []),
        finish_reason="stop" if comp.finish_reason == "stop" else "length",
        top_logprobs=tops,
    )


def _one_line(e: Exception) -> str:
    """An error's first line (the worker appends vLLM's traceback below it)."""
    text = str(e).strip().splitlines()
    return text[0][:500] if text else type(e).__name__


def make(parts: RolloutParts) -> VLLMRolloutBackend:
    """rank 0's vLLM backend, its worker sized from the engine's limits and device."""
    config = parts.model.base_model.config
    sharded_over = parts.world.size if parts.world is not None and parts.lockstep else 1
    try:
        args = vllm_engine_args(
            device_type=parts.device.type,
            dtype=dtype_name(parts.dtype),
            max_adapters=parts.model.max_adapters,
            max_rank=parts.model.max_rank,
            context_tokens=getattr(config, "max_position_embeddings", None),
            max_prompt_tokens=parts.max_prompt_tokens,
            max_new_tokens=MAX_NEW_TOKENS,
            max_step_tokens=parts.max_step_tokens,
            kv_bytes_per_token=kv_bytes_per_token(config, parts.dtype.itemsize),
            user_options=parts.options,
            trainer_device=str(parts.device),
            device_memory=cuda_free_and_total(parts.device),  # after the base loaded
            parent_visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
            sharded_over=sharded_over,
        )
    except ValueError as e:  # a placement that does not fit this device
        raise UsageError(f"vLLM: {e}") from e
    return VLLMRolloutBackend(
        parts.model_dir,
        parts.export,
        args,
        ignore_eos=parts.ignore_eos,
        eos_ids=parts.eos_ids,
    )
