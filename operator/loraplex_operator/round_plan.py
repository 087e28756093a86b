"""What one round decides (planning.py), as typed work items: each experiment's `Work`
(what its status will be derived from: publish.py), the engine calls (`Put`, `Unload`,
with why an experiment is unloaded) and the round's whole `RoundPlan`, which
reconcile.py carries out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from loraplex_operator import placement
from loraplex_operator import status as st
from loraplex_operator.resources import Experiment

NORMAL, WARNING = "Normal", "Warning"

# Why an experiment is unloaded from an engine (idle: a client experiment's idle TTL,
# suspended first: idle.py).
FINISHED, SUSPEND, DUPLICATE, ORPHAN, PREEMPT, IDLE = (
    "finished",
    "suspend",
    "duplicate",
    "orphan",
    "preempt",
    "idle",
)


@dataclass
class Work:
    """One experiment through one round: what its status will be derived from."""

    exp: Experiment
    binding: st.Binding | None = None
    engine_status: dict[str, Any] | None = None
    restarts: int = 0
    problems: list[str] = field(default_factory=list)
    waiting_reason: str | None = None
    waiting_message: str | None = None  # what the waiting reason is about, when known
    resume_from: str | None = None
    events: list[tuple[str, str, str]] = field(default_factory=list)  # type, reason, message
    republish: str | None = None  # its engine's URL: spec.publish changed (versions.py)

    @classmethod
    def start(cls, exp: Experiment) -> Work:
        """The experiment's work at the start of a round: its restarts so far."""
        return cls(exp=exp, restarts=exp.status.restarts)

    @property
    def obj(self) -> Mapping[str, Any]:
        return self.exp.raw

    @property
    def key(self) -> str:
        return self.exp.key

    @property
    def id(self) -> str:
        return self.exp.id

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))


@dataclass(frozen=True)
class Unload:
    engine: str
    url: str
    exp_id: str
    key: str | None
    reason: str
    for_key: str | None = None  # preemption: who gets the slot


@dataclass(frozen=True)
class Put:
    engine: str
    url: str
    node: str | None
    key: str
    exp_id: str
    body: dict[str, Any]


@dataclass
class RoundPlan:
    work: dict[str, Work]
    unloads: list[Unload] = field(default_factory=list)
    puts: list[Put] = field(default_factory=list)
    create_pods: int = 0
    delete_pods: list[str] = field(default_factory=list)
    recoveries: int = 0
    decisions: list[placement.Decision] = field(default_factory=list)
    idle_since: dict[str, float] = field(default_factory=dict)
