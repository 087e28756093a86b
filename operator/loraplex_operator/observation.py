"""What one round observes of one pool (pure data; `reconcile.py` gathers it).

Engines are the truth about placement: each `EngineView` says what its engine runs
(`GET /v1/experiments`) and holds (`GET /v1/capacity`); an experiment's `status.engine`
is only the operator's memory of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from loraplex_operator.resources import Experiment, Pool, parse_time


@dataclass
class EngineView:
    """One engine Pod and what its engine said this round."""

    name: str
    url: str | None = None
    node: str | None = None
    pod_ready: bool = False
    reachable: bool = False  # the engine answered /v1/capacity and /v1/experiments
    pod_phase: str | None = None
    capacity: Mapping[str, Any] | None = None
    experiments: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> status
    # Pod being deleted: epoch of its deletionTimestamp, by when the kubelet kills the
    # engine. Until then the engine may still be writing its SIGTERM checkpoints.
    deleting_until: float | None = None

    @property
    def usable(self) -> bool:
        return self.pod_ready and self.reachable and self.url is not None and not self.terminating

    @property
    def terminating(self) -> bool:
        return self.deleting_until is not None

    def draining(self, now: float) -> bool:
        """Deleted, alive, and its grace period not over: it may still be checkpointing."""
        return self.deleting_until is not None and not self.dead and now < self.deleting_until

    @property
    def dead(self) -> bool:
        """Its containers will not come back (evicted, node lost): replace the pod."""
        return self.pod_phase in ("Failed", "Succeeded")

    @property
    def used_slots(self) -> int:
        return int((self.capacity or {}).get("usedSlots", len(self.experiments)))

    def why_lost(self) -> str:
        if self.dead:
            return f"engine pod {self.name} is {self.pod_phase}"
        if self.terminating:
            return f"engine pod {self.name} outlived its deletion grace period"
        if not self.pod_ready:
            return f"engine pod {self.name} is not ready"
        if not self.reachable:
            return f"engine {self.name} does not answer"
        return f"engine {self.name} no longer runs it (engine restarted)"


def live(engines: list[EngineView]) -> list[EngineView]:
    """Engines that count: neither dead nor being deleted."""
    return [e for e in engines if not e.dead and not e.terminating]


def deleting_until(pod: Mapping[str, Any]) -> float | None:
    """A deleted pod's deletionTimestamp (the API server sets it to the deletion time plus
    the grace period); an unreadable one counts as already passed."""
    stamp = pod.get("metadata", {}).get("deletionTimestamp")
    if not stamp:
        return None
    return parse_time(stamp) or 0.0


@dataclass
class Snapshot:
    pool: Pool
    experiments: list[Experiment]  # LoRAExperiments naming this pool
    engines: list[EngineView]
    namespace_labels: dict[str, dict[str, str]] = field(default_factory=dict)
    now: float = 0.0  # epoch seconds
    idle_since: dict[str, float] = field(default_factory=dict)  # engine -> epoch
