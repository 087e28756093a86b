"""Which rollout backend an engine runs: chosen once, by the name its settings give
(``--rollout-backend``); from then on the engine asks the backend what it is
(``shares_trainer_weights``), never its name. Each backend builds itself from the same
parts of the engine; the vLLM one is imported only where it is chosen.
"""

from __future__ import annotations

from collections.abc import Callable

from loraplex_engine.rollout.backends import (
    FollowerRollout,
    RolloutBackend,
    RolloutParts,
    TorchRollout,
)


def _torch(parts: RolloutParts) -> RolloutBackend:
    eos = () if parts.ignore_eos else parts.eos_ids
    # its KV budget is set once the memory plan is made
    return TorchRollout(
        parts.route, parts.decode_forward, parts.pad_id, eos, lockstep=parts.lockstep
    )


def _vllm(parts: RolloutParts) -> RolloutBackend:
    if parts.world is not None and not parts.world.is_leader:
        return FollowerRollout()  # one vLLM per pod: rank 0's (parallel/data_parallel.py)
    from loraplex_engine.rollout.vllm.engine_backend import make

    return make(parts)


BACKENDS: dict[str, Callable[[RolloutParts], RolloutBackend]] = {"torch": _torch, "vllm": _vllm}


def build_rollout(name: str, parts: RolloutParts) -> RolloutBackend:
    try:
        builder = BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"rollout backend must be one of {sorted(BACKENDS)}, got {name!r}"
        ) from None
    return builder(parts)
