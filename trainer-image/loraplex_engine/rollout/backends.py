"""The engine's view of a rollout backend: generate rows, and keep adapters in sync.

``TorchRollout`` decodes through the engine's own multi-LoRA model (nothing to sync: the
rollout model is the trained model). ``VLLMRolloutBackend`` drives vLLM in its worker
process and pushes each adapter's new weights after every optimiser step.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from loraplex_engine.rollout.base import Completion, RolloutRequest
from loraplex_engine.rollout.packing import DEFAULT_ROLLOUT_KV_TOKENS
from loraplex_engine.rollout.torch_backend import ForwardFn, RouteFn, generate


class RolloutBackend(Protocol):
    name: str

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Completion]: ...

    def add_adapter(self, exp_id: str) -> None: ...

    def sync_adapters(self, exp_ids: Sequence[str]) -> None: ...

    def remove_adapter(self, exp_id: str) -> None: ...

    def close(self) -> None: ...


class TorchRollout:
    """Decode through the multi-LoRA model with every row routed to its slot, in
    micro-batches of at most ``kv_tokens`` KV-cache tokens (packing.py)."""

    name = "torch"

    def __init__(
        self,
        route: RouteFn,
        forward: ForwardFn,
        pad: int,
        eos_ids: Sequence[int],
        kv_tokens: int = DEFAULT_ROLLOUT_KV_TOKENS,
    ):
        self._route, self._forward, self._pad, self._eos = route, forward, pad, tuple(eos_ids)
        self.kv_tokens = kv_tokens

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Completion]:
        return generate(self._route, self._forward, requests, self._pad, self._eos, self.kv_tokens)

    def add_adapter(self, exp_id: str) -> None:
        pass

    def sync_adapters(self, exp_ids: Sequence[str]) -> None:
        pass

    def remove_adapter(self, exp_id: str) -> None:
        pass

    def close(self) -> None:
        pass


class VLLMRolloutBackend:
    """vLLM with one LoRA per experiment; adapters cross as PEFT directories.

    Rows that share temperature, ``top_p`` and token limit go in one ``generate`` call
    (vLLM takes one sampling setting per call); tenants with the same rollout settings —
    the usual case — share a batch; a served completion with its own seed goes alone. The
    worker answers whole rows: no per-token reports to a row's sink, no cancelling.
    Log-probs come back for the sampling distribution (``processed_logprobs``), which is
    what the trainer recomputes for the PPO ratio.
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
    ) -> None:
        from loraplex_engine.rollout.vllm_backend import VLLMRollout

        self._save = save_adapter
        self._ignore_eos = ignore_eos
        # Every EOS of the generation config stops a row, as in the torch rollout (vLLM
        # alone stops at the tokenizer's one EOS unless its generation config is read).
        self._stop_ids = [] if ignore_eos else list(eos_ids)
        self._dir = Path(tempfile.mkdtemp(prefix="loraplex-vllm-sync-"))
        # ``options``: the worker's settings, engine defaults merged with the user's
        # (vllm_config.py), each keyword once.
        self._vllm = VLLMRollout(model_dir, **{"logprobs_mode": "processed_logprobs", **options})

    @property
    def worker_info(self) -> dict[str, Any]:
        """What the worker reported at start: vLLM version, dtype, limits."""
        return self._vllm.info

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Completion]:
        out: list[Completion | None] = [None] * len(requests)
        for rows in _by_settings(requests).values():
            first = requests[rows[0]]
            seed = None
            if first.generator is not None:  # reproducible: drawn from the tenant's RNG
                seed = int(torch.randint(0, 2**31 - 1, (1,), generator=first.generator))
            results = self._vllm.generate(
                [(requests[i].adapter, requests[i].prompt_ids) for i in rows],
                n=1,
                max_new_tokens=first.max_new_tokens,
                temperature=first.temperature,
                top_p=first.top_p,
                seed=seed,
                stop_token_ids=self._stop_ids,
                ignore_eos=self._ignore_eos,
                top_logprobs=first.top_logprobs,
            )
            for i, [comp] in zip(rows, results, strict=True):
                tops = None
                if comp.top_logprobs is not None:
                    tops = [{int(t): lp for t, lp in step} for step in comp.top_logprobs]
                out[i] = Completion(
                    token_ids=list(comp.token_ids),
                    logprobs=list(comp.logprobs or []),
                    finish_reason="stop" if comp.finish_reason == "stop" else "length",
                    top_logprobs=tops,
                )
        return [c for c in out if c is not None]

    def add_adapter(self, exp_id: str) -> None:
        self._vllm.load_adapter(exp_id, self._write(exp_id))

    def sync_adapters(self, exp_ids: Sequence[str]) -> None:
        for exp_id in exp_ids:  # adapter-only: the base model stays loaded in vLLM
            self._vllm.update_adapter(exp_id, self._write(exp_id))

    def remove_adapter(self, exp_id: str) -> None:
        self._vllm.remove_adapter(exp_id)
        shutil.rmtree(self._dir / exp_id, ignore_errors=True)

    def close(self) -> None:
        self._vllm.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _write(self, exp_id: str) -> Path:
        path = self._dir / exp_id
        self._save(exp_id, path)
        return path


def _by_settings(requests: Sequence[RolloutRequest]) -> dict[tuple[Any, ...], list[int]]:
    """Rows that can share one vLLM call: one sampling setting; a seeded request alone."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, req in enumerate(requests):
        own = id(req.generator) if req.seeded else 0
        key = (req.temperature, req.max_new_tokens, req.top_p, req.top_logprobs, own)
        groups.setdefault(key, []).append(i)
    return groups
