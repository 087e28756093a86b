"""One adapter's optimiser settings, free of torch: an experiment's plan (plan/) carries
them, the per-adapter AdamW (train/optim.py) applies them."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex_engine.spec.algorithm import LR_SCHEDULES
from loraplex_engine.spec.errors import AdapterError
from loraplex_engine.spec.experiment import AlgorithmSpec
from loraplex_engine.train.lr_schedule import lr_factor


@dataclass(frozen=True)
class AdamWSettings:
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01  # torch.optim.AdamW's default
    max_grad_norm: float | None = None  # clip this adapter's gradient norm; None = never
    lr_schedule: str = "constant"  # lr_schedule.LR_SCHEDULES
    warmup_steps: int = 0
    total_steps: int = 0  # the run's length (cosine decays over it); 0 = continual

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        if self.lr < 0 or self.eps < 0 or self.weight_decay < 0:
            raise AdapterError(f"lr, eps and weight_decay must be >= 0: {self}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise AdapterError(f"betas must be in [0, 1): {self.betas}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise AdapterError(f"max_grad_norm must be > 0 (or None): {self.max_grad_norm}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise AdapterError(f"lr_schedule must be one of {LR_SCHEDULES}: {self.lr_schedule!r}")
        if self.warmup_steps < 0 or self.total_steps < 0:
            raise AdapterError(f"warmup_steps and total_steps must be >= 0: {self}")
        if self.lr_schedule == "cosine" and self.total_steps <= self.warmup_steps:
            raise AdapterError(f"cosine needs total_steps > warmup_steps: {self}")

    def lr_at(self, step: int) -> float:
        """The learning rate of this adapter's ``step``-th update (1-based)."""
        return self.lr * lr_factor(step, self.lr_schedule, self.warmup_steps, self.total_steps)


def adamw_settings(algorithm: AlgorithmSpec) -> AdamWSettings:
    """An experiment's optimiser settings, from its spec's algorithm block."""
    return AdamWSettings(
        lr=algorithm.learning_rate,
        weight_decay=0.0,
        max_grad_norm=algorithm.max_grad_norm,
        lr_schedule=algorithm.lr_schedule,
        warmup_steps=algorithm.warmup_steps,
        total_steps=algorithm.max_steps,
    )
