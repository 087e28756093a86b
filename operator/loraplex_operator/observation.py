"""What one round observes of one pool (pure data; `reconcile.py` gathers it).

Engines are the truth about placement: each `EngineView` says what its engine runs
(`GET /v1/experiments`) and holds (`GET /v1/capacity`); an experiment's `status.engine`
is only the operator's memory of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from loraplex_operator import manifests
from loraplex_operator import status as st
from loraplex_operator.engine_failures import PodFailure, pod_failure
from loraplex_operator.placement import ModelShape
from loraplex_operator.resources import Experiment, Pool, parse_time

# Why an experiment waits for an engine pod that has no node yet (its Wait reason).
WAIT_ADMISSION = st.WAITING_FOR_ADMISSION  # gated: Kueue has not admitted the pod
WAIT_ENGINE_UNSCHEDULABLE = "EngineUnschedulable"  # the scheduler found no node for it


@dataclass(frozen=True)
class EngineMemory:
    """The memory plan an engine reports on /v1/capacity (`plan`, the engine's
    `api_types.MemoryPlan`): how it sized itself. Every adapter slot is allocated at the
    engine's max rank on every linear it wraps, so each experiment costs `slot_bytes`,
    whatever its own rank and targets. A multi-rank engine (gpusPerEngine) reports one
    rank's plan: every rank holds every slot, so that is what a slot costs each GPU, and
    the pool's memoryBytes is a per-rank budget (nothing is multiplied by the ranks)."""

    slot_bytes: int  # fp32 weights, gradient and two Adam moments of one slot
    slots: int  # allocated: maxAdapters + 1 (slot 0 is the base model's)
    base_bytes: int
    device_bytes: int | None  # what the engine planned against (None: not known)
    micro_batch_tokens: int
    rollout_kv_tokens: int | None

    @classmethod
    def from_capacity(cls, capacity: Mapping[str, Any] | None) -> EngineMemory | None:
        """The `plan` block of a /v1/capacity answer; None for an engine without one."""
        plan = (capacity or {}).get("plan")
        if not isinstance(plan, Mapping):
            return None
        device, kv = plan.get("deviceBytes"), plan.get("rolloutKvTokens")
        return cls(
            slot_bytes=int(plan["slotBytes"]),
            slots=int(plan["slots"]),
            base_bytes=int(plan["baseBytes"]),
            device_bytes=None if device is None else int(device),
            micro_batch_tokens=int(plan["microBatchTokens"]),
            rollout_kv_tokens=None if kv is None else int(kv),
        )


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
    # No node yet: held by a scheduling gate (Kueue's admission gate), or the scheduler
    # found none (PodScheduled=False, Unschedulable). Capacity asked for, not there yet.
    gated: bool = False
    unschedulable: bool = False
    # Why it cannot serve and will not by itself (CrashLoopBackOff, ImagePullBackOff, ...).
    failure: PodFailure | None = None

    @classmethod
    def from_pod(
        cls, pod: Mapping[str, Any], now: float = 0.0, stall_after: float = float("inf")
    ) -> EngineView:
        """The pod's part of the view; the engine's answers are filled in by the probe.
        `stall_after`: seconds not ready (started) or unschedulable that make it failing."""
        spec, status = pod.get("spec") or {}, pod.get("status") or {}
        return cls(
            name=pod["metadata"]["name"],
            url=manifests.engine_url(pod),
            node=spec.get("nodeName"),
            pod_ready=manifests.is_pod_ready(pod),
            pod_phase=status.get("phase"),
            deleting_until=deleting_until(pod),
            gated=bool(spec.get("schedulingGates")),
            unschedulable=_unschedulable(status),
            failure=pod_failure(pod, now, stall_after),
        )

    @property
    def capacity_pending(self) -> str | None:
        """Why this engine's room is not there yet (a Wait reason), None if it is or soon
        will be (a pod on a node, starting)."""
        if self.terminating or self.dead:
            return None
        if self.gated:
            return WAIT_ADMISSION
        if self.unschedulable:
            return WAIT_ENGINE_UNSCHEDULABLE
        return None

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
    def memory(self) -> EngineMemory | None:
        """Its memory plan, once it has answered with one."""
        return EngineMemory.from_capacity(self.capacity) if self.reachable else None

    @property
    def storage_full(self) -> str | None:
        """Why its checkpoints wait for room on a full volume (`storageFull`), if they do."""
        full = (self.capacity or {}).get("storageFull")
        return str(full) if full else None

    @property
    def used_slots(self) -> int:
        return int((self.capacity or {}).get("usedSlots", len(self.experiments)))

    @property
    def max_registered(self) -> int | None:
        """Adapters it registers at most (`maxRegistered`); None: an engine before
        paging, whose slots are all it holds."""
        said = (self.capacity or {}).get("maxRegistered")
        return None if said is None else int(said)

    @property
    def registered(self) -> int:
        """Adapters it holds, resident in slots or paged out (what maxRegistered bounds)."""
        return self.used_slots + self.paging("pagedAdapters")

    def paging(self, field_name: str) -> int:
        """A paging count of its /v1/capacity (pagedAdapters, ...); 0 where not reported."""
        return int((self.capacity or {}).get(field_name) or 0)

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


def _unschedulable(pod_status: Mapping[str, Any]) -> bool:
    return any(
        c.get("type") == "PodScheduled"
        and c.get("status") == "False"
        and c.get("reason") == "Unschedulable"
        for c in pod_status.get("conditions") or ()
    )


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
    token_found: bool = True  # the pool's engine token Secret exists
    # A failed engine pod whose replacement waits (engine_failures.RecreateBackoff).
    recreate_held: PodFailure | None = None


def reported_shape(engines: Iterable[EngineView]) -> ModelShape | None:
    """The base model's shape as the first engine that answered reports it (`modelShape`
    on /v1/capacity); every engine of a pool loads the same model."""
    for e in engines:
        shape = (e.capacity or {}).get("modelShape") if e.reachable else None
        if shape:
            return ModelShape.model_validate(shape)
    return None


def slot_bytes(engines: Iterable[EngineView]) -> int | None:
    """What one experiment costs an engine of this pool this round, in bytes:

    - the slot bytes of the first engine that answered with a memory plan (every engine
      of a pool loads the same model at the same max rank);
    - None when the engines that answered report no plan (an older engine image): the
      adapter estimate from `modelShape` applies (`admission.experiment_memory_bytes`);
    - 0 while no engine has answered: memory is not known yet, so nothing is checked
      against it rather than guessed (nothing binds before an engine answers, and the
      round asks for one).
    """
    answered = [e for e in engines if e.reachable and e.capacity is not None]
    for e in answered:
        memory = e.memory
        if memory is not None:
            return memory.slot_bytes
    return None if answered else 0


def wrapped_modules(engines: Iterable[EngineView]) -> frozenset[str] | None:
    """The modules the pool's engines wrap (one base model: the first that reports them),
    None until one has (client_modules.py checks a client experiment's kinds with them)."""
    for e in engines:
        modules = (e.capacity or {}).get("targetModules") if e.reachable else None
        if isinstance(modules, list):
            return frozenset(str(m) for m in modules)
    return None


def with_reported_shape(snap: Snapshot) -> Snapshot:
    """The snapshot with the pool's `modelShape`, or else the one its engines report: a
    pool need not declare its model's dimensions. Until an engine reports, nothing is
    estimated (memory checks wait; nothing binds before an engine answers anyway)."""
    if snap.pool.spec.model_shape is not None:
        return snap
    shape = reported_shape(snap.engines)
    if shape is None:
        return snap
    pool = replace(snap.pool, spec=snap.pool.spec.model_copy(update={"model_shape": shape}))
    return replace(snap, pool=pool)


def pool_observation(snap: Snapshot) -> st.PoolObservation:
    """The pool's status inputs: its live engines counted, those without a node named."""
    engines = live(snap.engines)
    ready = [e for e in engines if e.usable]
    used = sum(e.used_slots for e in ready)
    total = sum(int((e.capacity or {}).get("maxAdapters", 0)) for e in ready)
    return st.PoolObservation(
        engines=len(engines),
        ready=len(ready),
        slots_used=used,
        slots_free=max(total - used, 0),
        min_replicas=snap.pool.spec.replicas.min,
        gated=sorted(e.name for e in engines if e.capacity_pending == WAIT_ADMISSION),
        unschedulable=sorted(
            e.name for e in engines if e.capacity_pending == WAIT_ENGINE_UNSCHEDULABLE
        ),
        token_found=snap.token_found,
        storage_full=sorted(
            (e.name, full) for e in engines if e.reachable and (full := e.storage_full)
        ),
        failures=failures(snap),
        plugins=next((p for e in ready if (p := (e.capacity or {}).get("plugins"))), None),
        paging=pool_paging(ready),
    )


def pool_paging(ready: list[EngineView]) -> st.PoolPaging:
    """The ready engines' registered adapters (each engine's `maxRegistered`, else its
    slots: what placement packs by) and the paging counts they report."""
    used = sum(e.registered for e in ready)
    room = sum(_registers(e) for e in ready)
    return st.PoolPaging(
        registered_used=used,
        registered_free=max(room - used, 0),
        paged_adapters=sum(e.paging("pagedAdapters") for e in ready),
        spilled_adapters=sum(e.paging("spilledAdapters") for e in ready),
        paged_host_bytes=sum(e.paging("pagedHostBytes") for e in ready),
    )


def _registers(e: EngineView) -> int:
    said = e.max_registered
    return int((e.capacity or {}).get("maxAdapters", 0)) if said is None else said


def failures(snap: Snapshot) -> list[PodFailure]:
    """The pool's engine pods that cannot serve (dead ones too, until removed), by pod
    name; else the failure that holds back their replacement."""
    found = sorted(
        (e.failure for e in snap.engines if e.failure is not None and not e.terminating),
        key=lambda f: f.pod,
    )
    if not found and snap.recreate_held is not None:
        return [snap.recreate_held]
    return found
