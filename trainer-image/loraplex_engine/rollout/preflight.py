"""What a rollout backend needs of its flags and environment, checked before the model
loads: a wrong flag answers at once, not after the model's seconds of loading. Chosen by
the backend's name, as rollout/select.py chooses the backend; each backend's checks live
with it (the vLLM ones in rollout/vllm/preflight.py). Imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable

from loraplex_engine.settings.engine import EngineSettings


def _torch(settings: EngineSettings, device: str) -> None:
    """The trainer's own model samples: nothing outside it to check."""


def _vllm(settings: EngineSettings, device: str) -> None:
    from loraplex_engine.rollout.vllm.preflight import check

    check(settings.vllm_options, device)


PREFLIGHTS: dict[str, Callable[[EngineSettings, str], None]] = {"torch": _torch, "vllm": _vllm}


def check_rollout(settings: EngineSettings, device: str) -> None:
    """``UsageError`` naming the flag when the chosen backend cannot run here; ``device``
    as given (``auto`` is not resolved yet)."""
    PREFLIGHTS[settings.rollout_backend](settings, device)
