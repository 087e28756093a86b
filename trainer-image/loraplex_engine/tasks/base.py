"""Task interface: a prompt source plus a verifiable reward.

Tasks are pure and deterministic: every random choice comes from the
``random.Random`` the caller passes (seeded per experiment), and scoring is a
batched call so an HTTP reward costs one round trip per step.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from loraplex_engine.spec.errors import TaskError
from loraplex_engine.tasks.rewards import BuiltinReward, Reward, RewardItem


@dataclass(frozen=True)
class Prompt:
    text: str
    answer: str
    meta: Mapping[str, str] = field(default_factory=dict)

    @property
    def position(self) -> str | None:
        """Where in its dataset the prompt is, for messages ("line 3" of a JSONL file read
        in place, "row 3" of a spooled one); None: a generated prompt."""
        for key in ("line", "row"):
            if key in self.meta:
                return f"{key} {self.meta[key]}"
        return None


class Task(ABC):
    """Subclasses set ``name``, ``PARAMS`` (name → default) and implement two methods."""

    name: ClassVar[str]
    PARAMS: ClassVar[Mapping[str, str]] = {}

    def __init__(self, params: Mapping[str, str] | None = None, reward: Reward | None = None):
        self.params = self.parse_params(params or {})
        # None → the task's own verifier.
        self.reward_fn: Reward = reward or BuiltinReward(f"{self.name}:default", self.verify)
        # A multi-turn environment's session (environments/session.py), set by build_task:
        # then the environment scores the episodes, not ``reward_fn``.
        self.environment: Any = None

    @classmethod
    def parse_params(cls, params: Mapping[str, str]) -> dict[str, str]:
        """Defaults merged with ``params``; unknown names rejected (typos fail loudly)."""
        for key in params:
            if key not in cls.PARAMS:
                known = ", ".join(sorted(cls.PARAMS)) or "none"
                raise TaskError(
                    f"spec.task.params.{key}",
                    f"unknown parameter for task {cls.name} (known: {known})",
                )
        merged = {**cls.PARAMS, **params}
        cls.check_params(merged)
        return merged

    @classmethod
    def check_params(cls, params: Mapping[str, str]) -> None:
        """Validate parameter values; raise ``TaskError``. Default: nothing to check."""
        return None

    @abstractmethod
    def sample_prompts(self, n: int, rng: random.Random) -> list[Prompt]: ...

    @abstractmethod
    def verify(self, completion: str, answer: str) -> float:
        """The task's own reward for one completion, in [0, 1]."""

    def score(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float]:
        """Rewards for a batch (one call to the reward, however it is computed)."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
        items = [
            RewardItem(prompt=p.text, completion=c, answer=p.answer, columns=p.meta)
            for p, c in zip(prompts, completions, strict=True)
        ]
        return self.reward_fn.score(items)

    def reward(self, prompt: Prompt, completion: str) -> float:
        return self.score([prompt], [completion])[0]

    def close(self) -> None:
        """Release the reward's resources (the HTTP client's connections)."""
        close = getattr(self.reward_fn, "close", None)
        if close is not None:
            close()
        if self.environment is not None:
            self.environment.close()


def int_param(params: Mapping[str, str], key: str, lo: int, hi: int) -> int:
    """Parse an integer parameter in [lo, hi], naming the field on failure."""
    raw = params[key]
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise TaskError(f"spec.task.params.{key}", f"must be an integer, got {raw!r}") from None
    if not lo <= value <= hi:
        raise TaskError(f"spec.task.params.{key}", f"must be in [{lo}, {hi}], got {value}")
    return value


def bool_param(params: Mapping[str, str], key: str) -> bool:
    raw = str(params[key]).strip().lower()
    if raw in ("true", "1", "yes"):
        return True
    if raw in ("false", "0", "no"):
        return False
    raise TaskError(f"spec.task.params.{key}", f"must be true or false, got {params[key]!r}")
