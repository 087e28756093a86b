"""What an engine takes, fixed once it is up: its flags and its base model's modules and
context. The one place an adapter's rank and target modules are checked against them
(an experiment's spec here, a client's ``lora_config`` in plan/client.py)."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex_engine.base_model import default_lora_targets
from loraplex_engine.tenancy.work_limits import WorkLimits


@dataclass(frozen=True)
class EngineLimits:
    """``target_modules``: the base model's adaptable modules, None where not known yet
    (the local runner before the model loads: targets go unchecked); ``work``: the step
    cost bounds, None where not known (likewise)."""

    max_rank: int
    target_modules: frozenset[str] | None = None
    work: WorkLimits | None = None

    @property
    def default_targets(self) -> tuple[str, ...] | None:
        """An adapter without targetModules gets these (base_model.default_lora_targets)."""
        known = self.target_modules
        return None if known is None else default_lora_targets(known)

    def rank_problem(self, rank: int) -> str | None:
        """Why an adapter of ``rank`` cannot be served here; None if it can."""
        if rank > self.max_rank:
            return f"rank {rank} exceeds the engine's max rank {self.max_rank}"
        if rank < 1:
            return f"rank {rank} must be at least 1"
        return None

    def targets_problem(self, targets: tuple[str, ...] | None) -> str | None:
        """Why ``targets`` (None: the default) cannot be adapted here; None if they can,
        or if the model's modules are not known."""
        known = self.target_modules
        if known is None:
            return None
        if targets is None:
            if self.default_targets is None:
                return (
                    "unset, and the base model has neither q_proj+v_proj nor qkv_proj to "
                    f"target by default; name them (supported: {sorted(known)})"
                )
            return None
        unknown = sorted(set(targets) - known)
        if unknown:
            return f"unknown target modules {unknown}; this engine wraps {sorted(known)}"
        return None
