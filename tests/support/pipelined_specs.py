"""Three tiny experiments for the pipelined schedule's tests (`staleness_specs`), and an
adapter's weights read out of a real engine's slot, to compare runs."""

from __future__ import annotations

from typing import Any

import torch

from tests.support.engine_builders import spec

STEPS = 4
TARGETS = ("yes", "no", "abc")


def staleness_specs(staleness: int) -> dict[str, Any]:
    out = {}
    for i, target in enumerate(TARGETS):
        s = spec(
            {"name": "target-token", "params": {"target": target}},
            lr=0.05,
            steps=STEPS,
            seed=10 + i,
            group=4,
            prompts=2,
            every=100,
        )
        alg = s.algorithm.model_copy(update={"max_staleness": staleness})
        out[f"exp{i}"] = s.model_copy(update={"algorithm": alg})
    return out


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.flatten() for t in tensors])


def slot_weights(eng: Any, exp_id: str) -> list[torch.Tensor]:
    slot = eng.model.slot_of(exp_id)
    return [
        p[slot].detach().clone()
        for layer in eng.model.lora_layers.values()
        for p in (layer.lora_A, layer.lora_B)
    ]
