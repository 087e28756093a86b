"""An experiment spec's body as users write it (the CRD's `spec`): LoRA on q/v and the
head of the tiny model, target-token unless a task is given. One builder for the engine's
in-process tests, the live engine's tenants and the benchmarks; each caller keeps its own
defaults."""

from __future__ import annotations

from typing import Any

# LoRA on lm_head: the tiny random model learns its tasks through the head (see
# docs/design/rl.md, "RL: tasks, rewards, GRPO").
TARGETS = ["q_proj", "v_proj", "lm_head"]


def spec_body(
    task: dict[str, Any] | None = None,
    *,
    rank: int,
    group: int,
    prompts: int,
    lr: float,
    steps: int,
    new_tokens: int,
    every: int,
    keep: int,
    seed: int | None = None,
    kl: float | None = None,
) -> dict[str, Any]:
    """LoRA alpha is twice the rank; ``seed`` and ``kl`` are written only when given (the
    engine's defaults otherwise)."""
    algorithm: dict[str, Any] = {
        "groupSize": group,
        "promptsPerStep": prompts,
        "learningRate": lr,
        "maxSteps": steps,
    }
    if seed is not None:
        algorithm["seed"] = seed
    if kl is not None:
        algorithm["klCoef"] = kl
    return {
        "lora": {"rank": rank, "alpha": 2 * rank, "targetModules": list(TARGETS)},
        "task": task or {"name": "target-token", "params": {"target": "yes"}},
        "algorithm": algorithm,
        "rollout": {"maxNewTokens": new_tokens, "temperature": 1.0},
        "checkpoint": {"everySteps": every, "keep": keep},
    }
