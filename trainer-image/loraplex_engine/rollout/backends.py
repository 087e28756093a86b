"""The engine's view of a rollout backend: generate rows, and keep adapters in sync.

``TorchRollout`` decodes through the engine's own multi-LoRA model (nothing to sync: the
rollout model is the trained model). ``VLLMRolloutBackend`` drives vLLM in its worker
process and pushes each adapter's new weights after every optimiser step.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from loraplex_engine.errors import VLLMWorkerError
from loraplex_engine.rollout.base import Completion, RolloutRequest
from loraplex_engine.rollout.packing import DEFAULT_ROLLOUT_KV_TOKENS
from loraplex_engine.rollout.torch_backend import ForwardFn, RouteFn, generate
from loraplex_engine.rollout.vllm_backend import RequestError, VLLMRollout
from loraplex_engine.rollout.vllm_requests import (
    RequestResult,
    VLLMRequest,
    by_group,
    failed,
    plan_requests,
    rows_from,
)

if TYPE_CHECKING:
    from loraplex_engine.sharding import Lockstep

log = logging.getLogger("loraplex_engine.rollout")
# Worker restarts one generate call may spend before it fails (and with it the tick).
MAX_RESTARTS = 2


class RolloutBackend(Protocol):
    name: str

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Completion]: ...

    def add_adapter(self, exp_id: str) -> None: ...

    def sync_adapters(self, exp_ids: Sequence[str]) -> dict[str, str]:
        """Push new weights; returns the experiments whose update failed, with why."""
        ...

    def remove_adapter(self, exp_id: str) -> None: ...

    def training_phase(self) -> AbstractContextManager[None]:
        """Held while the trainer trains: a sampler sharing its device steps aside."""
        ...

    def close(self) -> None: ...


# rows -> every row's completion, decoded over the data-parallel ranks
Distribute = Callable[[Sequence[RolloutRequest]], list[Completion]]


class TorchRollout:
    """Decode through the multi-LoRA model with every row routed to its slot, in
    micro-batches of at most ``kv_tokens`` KV-cache tokens (packing.py).

    Data parallel (data_parallel.py): ``distribute`` spreads a batch over the ranks,
    each decoding its share with ``generate_local``; ``lockstep`` (a sharded base) keeps
    their forwards in step."""

    name = "torch"

    def __init__(
        self,
        route: RouteFn,
        forward: ForwardFn,
        pad: int,
        eos_ids: Sequence[int],
        kv_tokens: int = DEFAULT_ROLLOUT_KV_TOKENS,
        lockstep: Lockstep | None = None,
    ):
        self._route, self._forward, self._pad, self._eos = route, forward, pad, tuple(eos_ids)
        self.kv_tokens = kv_tokens
        self.lockstep = lockstep
        self.distribute: Distribute | None = None

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Completion]:
        if self.distribute is not None:
            return self.distribute(requests)
        return self.generate_local(requests)

    def generate_local(self, requests: Sequence[RolloutRequest]) -> list[Completion]:
        """This process's rows alone (this rank's share, under data parallelism)."""
        return generate(
            self._route,
            self._forward,
            requests,
            self._pad,
            self._eos,
            self.kv_tokens,
            self.lockstep,
        )

    def add_adapter(self, exp_id: str) -> None:
        pass

    def sync_adapters(self, exp_ids: Sequence[str]) -> dict[str, str]:
        return {}

    def remove_adapter(self, exp_id: str) -> None:
        pass

    def training_phase(self) -> AbstractContextManager[None]:
        return nullcontext()  # the rollout model is the trained model

    def close(self) -> None:
        pass


class VLLMRolloutBackend:
    """vLLM with one LoRA per experiment; adapters cross as PEFT directories.

    Requests (vllm_requests.py): one vLLM request per prompt of an experiment, with
    ``n`` = its rows of that prompt (``groupSize``), so vLLM computes the prompt once;
    every experiment's and served completion's requests go in one batch, each with its
    own sampling settings. Seeded where reproducibility is wanted (vllm_requests.py).
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

    def __init__(
        self,
        model_dir: str | Path,
        save_adapter: Callable[[str, Path], None],
        options: dict[str, Any],
        *,
        ignore_eos: bool = False,
        eos_ids: Sequence[int] = (),
        start: Callable[[], VLLMRollout] | None = None,
    ) -> None:
        self._save = save_adapter
        self._ignore_eos = ignore_eos
        # Every EOS of the generation config stops a row, as in the torch rollout (vLLM
        # alone stops at the tokenizer's one EOS unless its generation config is read).
        self._stop_ids = [] if ignore_eos else list(eos_ids)
        self._dir = Path(tempfile.mkdtemp(prefix="loraplex-vllm-sync-"))
        # ``options``: the worker's settings, engine defaults merged with the user's
        # (vllm_config.py), each keyword once.
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
        self._vllm.load_adapter(exp_id, self._write(exp_id))
        self._adapters.append(exp_id)

    def sync_adapters(self, exp_ids: Sequence[str]) -> dict[str, str]:
        """Push each adapter's new weights (the base model stays loaded in vLLM);
        returns the experiments whose update vLLM refused, with why."""
        self._ensure_worker()
        refused: dict[str, str] = {}
        for exp_id in exp_ids:
            try:
                self._vllm.update_adapter(exp_id, self._write(exp_id))
            except VLLMWorkerError as e:
                if self._vllm.alive:
                    refused[exp_id] = _one_line(e)
                    continue
                # A restart loads every adapter at its current weights: that is the sync.
                self._restart(_one_line(e))
                break
        return refused

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

    def _restart(self, cause: str) -> None:
        """A fresh worker with every adapter re-loaded from the engine's weights (the
        trained ones: the engine's model is the source of truth). One that fails to
        load is left out: its experiment's requests then fail alone."""
        log.warning("restarting the vLLM worker (%s) with %d adapters", cause, len(self._adapters))
        self._vllm.close(timeout=5)
        self.restarts += 1
        self._vllm = self._start()
        for exp_id in list(self._adapters):
            try:
                self._vllm.load_adapter(exp_id, self._write(exp_id))
            except VLLMWorkerError:
                log.warning("the restarted vLLM worker refused adapter %s", exp_id, exc_info=True)
                self._adapters.remove(exp_id)

    def _write(self, exp_id: str) -> Path:
        path = self._dir / exp_id
        self._save(exp_id, path)
        return path


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
