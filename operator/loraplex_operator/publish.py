"""Publishing what a round learnt about an experiment, written once for every caller.

One path, whoever has news of an experiment (a pool's round, the pool's deletion, an
experiment whose pool does not exist): admission events → derive the status (pure,
`status.derive_status`) → compare with the status written last → write the fields that
changed (a change of progress alone at most every `status_interval`: a busy engine moves
`step` every few tens of milliseconds) → emit the round's Events. A pool's own status
goes the same compare-then-write way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any

from loraplex_operator import idle, versions
from loraplex_operator import metrics as m
from loraplex_operator import status as st
from loraplex_operator.aibrix import AdapterSync
from loraplex_operator.api.status import EnginePoolStatus, ExperimentStatus
from loraplex_operator.config import Config
from loraplex_operator.kube import EXPERIMENTS, POOLS, Kube, KubeError
from loraplex_operator.resources import Experiment, Pool
from loraplex_operator.round_plan import NORMAL, WARNING, Work

log = logging.getLogger("loraplex_operator.publish")

# Status fields whose change alone is progress (throttled); anything else is written at once.
PROGRESS_FIELDS = frozenset({"step", "progress", "reward", "observedGeneration"})

EventSink = Callable[[Mapping[str, Any], str, str, str], None]


def kopf_event(obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    import kopf

    kopf.event(dict(obj), type=type_, reason=reason, message=message[:1024])


# --- pure ------------------------------------------------------------------------------


def derive(w: Work, config: Config, now: datetime) -> ExperimentStatus:
    obs = st.Observation(
        binding=w.binding,
        engine_status=w.engine_status,
        problems=w.problems,
        waiting_reason=w.waiting_reason,
        waiting_message=w.waiting_message,
        restarts=w.restarts,
        max_restarts=config.max_restarts,
    )
    return st.derive_status(w.exp, obs, now)


def status_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> set[str]:
    """Top-level status fields that differ between the status as read and a merge patch
    of it (None in `new` = removed)."""
    changed = set()
    for k, v in new.items():
        if v is None:
            if old.get(k) is not None:
                changed.add(k)
        elif old.get(k) != v:
            changed.add(k)
    return changed


def admission_events(w: Work) -> None:
    """An Event when admission problems appear or change, and when they are resolved."""
    old = st.get_condition(w.exp.status.conditions, st.ADMITTED)
    if w.problems:
        message = "; ".join(w.problems)
        if old is None or old.get("status") != "False" or old.get("message") != message:
            w.event(WARNING, "AdmissionFailed", message)
    elif old is not None and old.get("status") == "False" and w.exp.status.phase == st.PENDING:
        w.event(NORMAL, "Admitted", "admission problems resolved")


def terminal_event(w: Work, old_phase: str | None, new: ExperimentStatus) -> None:
    if new.phase != old_phase and new.phase in st.TERMINAL:
        type_ = NORMAL if new.phase == st.SUCCEEDED else WARNING
        w.event(type_, new.phase, new.message or "")


def alias_events(w: Work, new: ExperimentStatus) -> None:
    """An Event and a count (loraplex_alias_moves) for each alias the engine moved since
    the status written last: a publish (latest), a promotion or rollback (stable), another
    alias set or moved by hand (versions.py)."""
    if new.aliases is None:
        return
    for move in versions.moves(w.exp.raw_status.get("aliases"), new.aliases):
        w.event(*move.event())
        m.ALIAS_MOVES.labels(pool=w.exp.spec.engine_pool, kind=move.kind).inc()


def gate_events(w: Work, new: ExperimentStatus, evented: int) -> int:
    """A Warning Event `VersionGateFailed` for each version newly reported to have failed
    its promotion gate, with why (versions.py); the newest version number told of."""
    for v in versions.new_gate_failures(
        w.exp.raw_status.get("versions"), new.versions or (), evented
    ):
        w.event(WARNING, "VersionGateFailed", versions.gate_failure(v))
        evented = max(evented, versions.number(v.version))
    return evented


def experiment_state(exp: Experiment, status: ExperimentStatus) -> m.ExperimentState:
    """The per-experiment metrics for `exp` whose derived status is `status` (pure).

    From the status this round derives, not the one last written: progress-only writes
    are throttled, the metrics are not.
    """
    return m.ExperimentState(
        namespace=exp.meta.namespace,
        experiment=exp.id,
        phase=str(status.phase),
        reason=st.phase_reason(status),
        restarts=status.restarts or 0,
        step=status.step or 0,
        max_steps=exp.spec.algorithm.max_steps,
        stable_version=versions.stable_number(status.aliases),
    )


# --- I/O -------------------------------------------------------------------------------


class StatusPublisher:
    """Writes statuses and emits Events; remembers when it last wrote each one, and the
    restarts it wrote (see `publish`)."""

    def __init__(self, kube: Kube, emit: EventSink, config: Config) -> None:
        self.kube = kube
        self.emit = emit
        self.config = config
        self.last_write: dict[str, float] = {}  # experiment key -> monotonic seconds
        self.restarts: dict[tuple[str, str | None], int] = {}  # (key, uid) -> last written
        # (key, uid) -> the newest version whose failed gate was evented (gate_events).
        self.gate_told: dict[tuple[str, str | None], int] = {}
        # AIBrix ModelAdapters per alias (aibrix.py), when the chart turns them on.
        self.adapters = AdapterSync(kube, config.aibrix) if config.aibrix else None

    async def publish(self, w: Work, now: datetime) -> ExperimentStatus:
        """Derive `w`'s status, emit its Events, write what changed; the derived status.

        `restarts` never goes back below what this operator wrote for the same object: a
        round woken right after a recovery's write (by its engine Pod turning Failed) may
        read the experiment from a cache that has not seen that write yet, and would
        otherwise write the old count back with its new engine."""
        w.restarts = max(w.restarts, self.restarts.get((w.key, w.exp.meta.uid), 0))
        admission_events(w)
        new = derive(w, self.config, now)
        terminal_event(w, w.exp.status.phase, new)
        alias_events(w, new)
        key_uid = (w.key, w.exp.meta.uid)
        self.gate_told[key_uid] = gate_events(w, new, self.gate_told.get(key_uid, 0))
        for type_, reason, message in w.events:
            if type_ == WARNING:
                log.warning("%s: %s: %s", w.key, reason, message)
            self.emit(w.obj, type_, reason, message)
        patch = new.to_patch()
        changed = status_changes(w.exp.raw_status, patch)
        if changed and self._due(w.key, changed):
            await self._write(w, patch)
        if self.adapters is not None:
            self.adapters.kube = self.kube  # the reconciler may swap its client
            await self.adapters.sync(w.key, w.exp, new.aliases)
        return new

    def forget_others(self, keys: Iterable[str]) -> None:
        """Keep write times only for `keys`: deleted experiments leave the rounds, and the
        map would otherwise grow with every experiment the pool ever ran."""
        keep = set(keys)
        for key in self.last_write.keys() - keep:
            del self.last_write[key]
        for table in (self.restarts, self.gate_told):
            for key_uid in [k for k in table if k[0] not in keep]:
                del table[key_uid]
        if self.adapters is not None:
            self.adapters.forget_others(keep)

    def _due(self, key: str, changed: set[str]) -> bool:
        if changed - PROGRESS_FIELDS:
            return True
        last = self.last_write.get(key, 0.0)
        return time.monotonic() - last >= self.config.status_interval

    async def _write(self, w: Work, status: dict[str, Any]) -> None:
        """Patch `status` (a merge patch: `ExperimentStatus.to_patch`)."""
        try:
            await self.kube.patch(
                EXPERIMENTS,
                w.exp.meta.name,
                {"status": status},
                namespace=w.exp.meta.namespace,
                subresource="status",
            )
            self.last_write[w.key] = time.monotonic()
            self.restarts[(w.key, w.exp.meta.uid)] = int(status.get("restarts") or 0)
        except KubeError as e:
            m.RECONCILE_ERRORS.labels(kind="status").inc()
            log.warning("status of %s: %s", w.key, e)

    async def suspend_idle(self, w: Work, now: datetime) -> bool:
        """Suspend a client experiment its idle TTL ended (idle.py), before its unload: the
        round's status then says so; False (not unloaded, tried next round) if not written."""
        meta, patch = w.exp.meta, idle.suspend_patch(now)
        try:
            found = await self.kube.patch(EXPERIMENTS, meta.name, patch, namespace=meta.namespace)
        except KubeError as e:
            m.RECONCILE_ERRORS.labels(kind="unload").inc()  # its unload waits
            log.warning("idle suspend of %s: %s", w.key, e)
            return False
        if found is not None:
            w.exp = Experiment.from_obj(idle.merged(w.exp.raw, patch))
        return found is not None

    async def publish_pool(self, pool: Pool, status: EnginePoolStatus) -> None:
        new = status.to_json()
        if not status_changes(pool.raw_status, new):
            return
        try:
            await self.kube.patch(POOLS, pool.name, {"status": new}, subresource="status")
        except KubeError as e:
            m.RECONCILE_ERRORS.labels(kind="status").inc()
            log.warning("pool status %s: %s", pool.name, e)
