"""One adapter's shape, free of torch: what an experiment's plan (plan/) carries and
the model's slots (lora/model.py) are set to."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex_engine.spec.errors import AdapterError


@dataclass(frozen=True)
class LoRAConfig:
    """One adapter's settings; ``scale = alpha / rank`` (PEFT's default, no rsLoRA)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")

    def __post_init__(self) -> None:
        # A set in meaning: sorted, so equal configs compare equal.
        object.__setattr__(self, "target_modules", tuple(sorted(set(self.target_modules))))
        if not isinstance(self.rank, int) or self.rank < 1:
            raise AdapterError(f"rank must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise AdapterError(f"alpha must be positive, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise AdapterError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules:
            raise AdapterError("target_modules must name at least one module")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank
