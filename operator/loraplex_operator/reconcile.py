"""The level-based pool reconciler: one round = observe, plan, act.

Every round for one EnginePool:

1. **observe** (`PoolReconciler.observe`): the pool, every LoRAExperiment naming it, the
   pool's engine Pods, and — from every ready engine — what it actually runs
   (`GET /v1/capacity`, `GET /v1/experiments`). Engines are the truth about placement;
   `status.engine` is only the operator's memory of it.
2. **plan** (`plan_round`, pure): per experiment, adopt what an engine runs, recover what
   a lost engine ran (restarts + 1, resume from `status.checkpoint`, which the engine
   takes as "this or a newer checkpoint of the same run"; every bind names the run, the
   object's `metadata.uid`, so with no checkpoint in the status the engine still resumes
   the run's newest one; a deleted engine is first left
   to finish its SIGTERM checkpoints), unload what must not run (finished, suspended,
   duplicated, orphaned), admit or reject, then hand the pending ones to
   `placement.plan` for binds, preemptions and scale-up; scale idle engines down.
3. **act** (`PoolReconciler.act`): unloads and preemptions (`DELETE` = checkpoint +
   unload), binds (`PUT`, idempotent), Pod creates/deletes, then one status patch per
   experiment whose derived status changed (progress-only changes at most every
   `status_interval`), Events, metrics.

Because each round starts from what the engines say, a restarted operator re-derives
everything: an experiment an engine runs is adopted, never bound a second time; one
that no engine runs but whose status names an engine is recovered from its checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import random
import string
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from loraplex_operator import admission, manifests, placement
from loraplex_operator import metrics as m
from loraplex_operator import status as st
from loraplex_operator.engine_client import (
    EngineClient,
    EngineError,
    EngineUnreachable,
    experiment_id,
)
from loraplex_operator.kube import EXPERIMENTS, NAMESPACES, PODS, POOLS, Kube, KubeError

log = logging.getLogger("loraplex_operator.reconcile")

NORMAL, WARNING = "Normal", "Warning"

# Unload reasons
FINISHED, SUSPEND, DUPLICATE, ORPHAN, PREEMPT = (
    "finished",
    "suspend",
    "duplicate",
    "orphan",
    "preempt",
)
# Status fields whose change alone is progress (throttled); anything else is written at once.
PROGRESS_FIELDS = frozenset({"step", "reward", "observedGeneration"})


@dataclass(frozen=True)
class Config:
    interval: float = 5.0  # seconds between rounds of one pool
    status_interval: float = 10.0  # min seconds between progress-only status writes
    scale_down_delay: float = 60.0  # an engine idle this long (above min) is removed
    max_restarts: int = st.DEFAULT_MAX_RESTARTS
    engine_timeout: float = 30.0
    # Namespaces whose experiments this operator may read (namespaced RBAC); () = all.
    namespaces: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Config:
        def num(name: str, default: float) -> float:
            return float(env.get(f"LORAPLEX_{name}", default))

        return cls(
            interval=num("RECONCILE_INTERVAL", cls.interval),
            status_interval=num("STATUS_INTERVAL", cls.status_interval),
            scale_down_delay=num("SCALE_DOWN_DELAY", cls.scale_down_delay),
            max_restarts=int(num("MAX_RESTARTS", cls.max_restarts)),
            engine_timeout=num("ENGINE_TIMEOUT", cls.engine_timeout),
            namespaces=tuple(
                n.strip()
                for n in env.get("LORAPLEX_WATCH_NAMESPACES", "").replace(" ", ",").split(",")
                if n.strip()
            ),
        )


# --- observation -----------------------------------------------------------------------


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


@dataclass
class Snapshot:
    pool: dict[str, Any]
    experiments: list[dict[str, Any]]  # LoRAExperiments naming this pool
    engines: list[EngineView]
    namespace_labels: dict[str, dict[str, str]] = field(default_factory=dict)
    now: float = 0.0  # epoch seconds
    idle_since: dict[str, float] = field(default_factory=dict)  # engine -> epoch


# --- the plan ----------------------------------------------------------------------------


@dataclass
class Work:
    """One experiment through one round: what status will be derived from."""

    obj: dict[str, Any]
    binding: st.Binding | None = None
    engine_status: dict[str, Any] | None = None
    restarts: int = 0
    problems: list[str] = field(default_factory=list)
    waiting_reason: str | None = None
    resume_from: str | None = None
    events: list[tuple[str, str, str]] = field(default_factory=list)  # type, reason, message

    @property
    def key(self) -> str:
        return key_of(self.obj)

    @property
    def id(self) -> str:
        meta = self.obj["metadata"]
        return experiment_id(meta.get("namespace", "default"), meta["name"])

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


def key_of(obj: Mapping[str, Any]) -> str:
    meta = obj["metadata"]
    return f"{meta.get('namespace', 'default')}/{meta['name']}"


def parse_time(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _phase(obj: Mapping[str, Any]) -> str | None:
    return (obj.get("status") or {}).get("phase")


def _deleting(obj: Mapping[str, Any]) -> bool:
    return bool(obj.get("metadata", {}).get("deletionTimestamp"))


def _checkpoint_path(obj: Mapping[str, Any]) -> str | None:
    ckpt = (obj.get("status") or {}).get("checkpoint") or {}
    return ckpt.get("path")


def _checkpoint_step(obj: Mapping[str, Any]) -> int | None:
    ckpt = (obj.get("status") or {}).get("checkpoint") or {}
    return ckpt.get("step")


def _capacity(pool: Mapping[str, Any]) -> dict[str, Any]:
    return pool.get("spec", {}).get("capacity", {})


def _replicas(pool: Mapping[str, Any]) -> tuple[int, int]:
    r = pool.get("spec", {}).get("replicas", {})
    return int(r.get("min", 0)), int(r.get("max", 1))


def plan_round(snap: Snapshot, config: Config) -> RoundPlan:
    """Everything one round should do, from one observation (pure)."""
    pool = snap.pool
    pool_spec = pool.get("spec", {})
    live = _live(snap.engines)
    by_name = {e.name: e for e in live}
    all_engines = {e.name: e for e in snap.engines}
    holders: dict[str, list[EngineView]] = {}
    for engine in live:
        if engine.reachable:
            for exp_id in engine.experiments:
                holders.setdefault(exp_id, []).append(engine)

    plan = RoundPlan(work={})
    plan.delete_pods.extend(e.name for e in snap.engines if e.dead and not e.terminating)
    known_ids: set[str] = set()
    pending: list[placement.PendingExperiment] = []
    running_on: dict[str, list[placement.RunningExperiment]] = {}
    memory_on: dict[str, int] = {}

    for obj in sorted(snap.experiments, key=key_of):
        w = Work(obj=obj, restarts=int((obj.get("status") or {}).get("restarts", 0)))
        known_ids.add(w.id)
        if _deleting(obj):
            continue  # the finalizer handler unloads it
        plan.work[w.key] = w
        spec = obj.get("spec", {})
        recorded = (obj.get("status") or {}).get("engine")
        on = sorted(holders.get(w.id, []), key=lambda e: (e.name != recorded, e.name))

        if _phase(obj) in st.TERMINAL:
            plan.unloads.extend(Unload(e.name, e.url or "", w.id, w.key, FINISHED) for e in on)
            continue
        if on:
            primary, extra = on[0], on[1:]
            plan.unloads.extend(Unload(e.name, e.url or "", w.id, w.key, DUPLICATE) for e in extra)
            w.binding = st.Binding(primary.name, primary.node)
            w.engine_status = dict(primary.experiments[w.id])
            if recorded != primary.name:
                w.event(NORMAL, "Adopted", f"found running on engine {primary.name}")
            engine_phase = w.engine_status.get("phase")
            if engine_phase in st.TERMINAL:
                pass  # recorded this round; unloaded once status says so (next round)
            elif spec.get("suspend"):
                plan.unloads.append(Unload(primary.name, primary.url or "", w.id, w.key, SUSPEND))
            else:
                mem = admission.experiment_memory_bytes(spec, pool_spec)
                running_on.setdefault(primary.name, []).append(
                    placement.RunningExperiment(
                        key=w.key,
                        priority=int(spec.get("priority", 0)),
                        rank=int(spec.get("lora", {}).get("rank", 8)),
                        memory_bytes=mem,
                        started=parse_time(w.engine_status.get("startedAt")) or 0.0,
                    )
                )
                memory_on[primary.name] = memory_on.get(primary.name, 0) + mem
            continue

        # Not running anywhere.
        if spec.get("suspend"):
            continue
        if recorded:
            engine = all_engines.get(recorded)
            if engine is not None and engine.draining(snap.now):
                _await_drain(w, engine)
                continue
            why = engine.why_lost() if engine else f"engine pod {recorded} is gone"
            w.restarts += 1
            plan.recoveries += 1
            step = _checkpoint_step(obj)
            where = (
                f"checkpoint at step {step} or a newer one of its run"
                if step is not None
                else "its run's newest checkpoint, if it has one"
            )
            if w.restarts > config.max_restarts:
                w.event(
                    WARNING,
                    "RestartBudgetExhausted",
                    f"{why}; restarted {w.restarts} times (budget {config.max_restarts})",
                )
                continue
            w.event(WARNING, "EngineLost", f"{why}; will resume from {where} on another engine")
        ns = obj["metadata"].get("namespace", "default")
        problems = admission.check_experiment(obj, pool, snap.namespace_labels.get(ns))
        w.problems = [str(p) for p in problems]
        if w.problems:
            continue
        w.resume_from = _checkpoint_path(obj)
        created = parse_time(obj["metadata"].get("creationTimestamp")) or 0.0
        pending.append(
            placement.PendingExperiment(
                key=w.key,
                priority=int(spec.get("priority", 0)),
                created=created,
                rank=int(spec.get("lora", {}).get("rank", 8)),
                memory_bytes=admission.experiment_memory_bytes(spec, pool_spec),
            )
        )

    # Experiments an engine runs that no LoRAExperiment of this pool names: unload.
    for exp_id, engines in sorted(holders.items()):
        if exp_id not in known_ids:
            plan.unloads.extend(Unload(e.name, e.url or "", exp_id, None, ORPHAN) for e in engines)

    capacity = _capacity(pool)
    slots = int(capacity.get("maxAdapters", 8))
    max_rank = int(capacity.get("maxRank", 64))
    budget = int(capacity.get("memoryBytes", 0))
    engines: list[placement.Engine] = []
    for e in live:
        if e.usable:
            cap = e.capacity or {}
            used = int(cap.get("usedSlots", len(e.experiments)))
            engines.append(
                placement.Engine(
                    name=e.name,
                    ready=True,
                    slots_total=int(cap.get("maxAdapters", slots)),
                    slots_used=used,
                    max_rank=int(cap.get("maxRank", max_rank)),
                    memory_budget=budget,
                    memory_used=memory_on.get(e.name, 0),
                    running=tuple(running_on.get(e.name, ())),
                )
            )
        else:
            engines.append(
                placement.Engine(e.name, False, slots, 0, max_rank, memory_budget=budget)
            )
    lo, hi = _replicas(pool)
    limits = placement.PoolLimits(
        max_replicas=hi,
        current_replicas=len(live),
        slots_per_engine=slots,
        max_rank=max_rank,
        memory_budget=budget,
    )
    plan.decisions = placement.plan(pending, engines, limits)

    bound_to: set[str] = set()
    waiting = False
    for d in plan.decisions:
        if isinstance(d, placement.Bind):
            w = plan.work[d.experiment]
            engine = by_name[d.engine]
            meta = w.obj["metadata"]
            body = {
                "spec": w.obj.get("spec", {}),
                "namespace": meta.get("namespace", "default"),
                "name": meta["name"],
                "resumeFrom": w.resume_from,
                "runId": _run_id(meta),
            }
            plan.puts.append(Put(engine.name, engine.url or "", engine.node, w.key, w.id, body))
            bound_to.add(engine.name)
        elif isinstance(d, placement.Preempt):
            engine = by_name[d.engine]
            victim = plan.work[d.victim]
            plan.unloads.append(
                Unload(
                    engine.name, engine.url or "", victim.id, d.victim, PREEMPT, d.for_experiment
                )
            )
        elif isinstance(d, placement.ScaleUp):
            plan.create_pods += d.count
        elif isinstance(d, placement.Wait):
            plan.work[d.experiment].waiting_reason = d.reason
            if d.reason != placement.WAIT_UNSCHEDULABLE:
                waiting = True

    # Keep at least replicas.min engines.
    plan.create_pods += max(lo - len(live) - plan.create_pods, 0)

    # Scale down: engines idle for scale_down_delay, above the minimum, when nothing waits.
    busy = {u.engine for u in plan.unloads} | bound_to
    idle = [e for e in live if e.usable and not e.experiments and e.name not in busy]
    plan.idle_since = {e.name: snap.idle_since.get(e.name, snap.now) for e in idle}
    if not waiting and plan.create_pods == 0:
        removable = len(live) - lo
        for e in sorted(idle, key=lambda e: e.name, reverse=True):
            if removable <= 0:
                break
            if snap.now - plan.idle_since[e.name] >= config.scale_down_delay:
                plan.delete_pods.append(e.name)
                removable -= 1
    return plan


# --- status ----------------------------------------------------------------------------


def _live(engines: list[EngineView]) -> list[EngineView]:
    """Engines that count: neither dead nor being deleted."""
    return [e for e in engines if not e.dead and not e.terminating]


def _await_drain(w: Work, engine: EngineView) -> None:
    """Keep the experiment bound to its deleted engine until that engine is gone: it
    checkpoints on SIGTERM, and resuming elsewhere first would race that checkpoint (the
    new engine would start from an older one, and both would write the same steps)."""
    old = w.obj.get("status") or {}
    w.binding = st.Binding(engine.name, old.get("node"))
    w.engine_status = {"phase": old["phase"]} if old.get("phase") == st.RUNNING else None
    log.info("%s: engine pod %s is shutting down; resume waits for it", w.key, engine.name)


def derive(w: Work, config: Config, now: datetime) -> dict[str, Any]:
    obs = st.Observation(
        binding=w.binding,
        engine_status=w.engine_status,
        problems=w.problems,
        waiting_reason=w.waiting_reason,
        restarts=w.restarts,
        max_restarts=config.max_restarts,
    )
    return st.derive_status(w.obj, obs, now)


def status_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> set[str]:
    """Top-level status fields that differ (None in `new` = removed)."""
    changed = set()
    for k, v in new.items():
        if v is None:
            if old.get(k) is not None:
                changed.add(k)
        elif old.get(k) != v:
            changed.add(k)
    return changed


def experiment_state(obj: Mapping[str, Any], status: Mapping[str, Any]) -> m.ExperimentState:
    """The per-experiment metrics for `obj` whose derived status is `status` (pure).

    From the status this round derives, not the one last written: progress-only writes
    are throttled, the metrics are not.
    """
    meta = obj["metadata"]
    namespace = meta.get("namespace", "default")
    return m.ExperimentState(
        namespace=namespace,
        experiment=experiment_id(namespace, meta["name"]),
        phase=status["phase"],
        reason=st.phase_reason(status),
        restarts=int(status.get("restarts") or 0),
        step=int(status.get("step") or 0),
        max_steps=st.max_steps(obj.get("spec", {})),
    )


def admission_events(w: Work) -> None:
    old = st.get_condition((w.obj.get("status") or {}).get("conditions"), st.ADMITTED)
    if w.problems:
        message = "; ".join(w.problems)
        if old is None or old.get("status") != "False" or old.get("message") != message:
            w.event(WARNING, "AdmissionFailed", message)
    elif old is not None and old.get("status") == "False" and _phase(w.obj) == st.PENDING:
        w.event(NORMAL, "Admitted", "admission problems resolved")


# --- I/O -------------------------------------------------------------------------------

EventSink = Callable[[Mapping[str, Any], str, str, str], None]


def kopf_event(obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    import kopf

    kopf.event(dict(obj), type=type_, reason=reason, message=message[:1024])


def _run_id(meta: Mapping[str, Any]) -> str | None:
    """The run a bind names: the object's uid (one per incarnation, the same through every
    recovery), so the engine writes its checkpoints into a directory of their own and can
    resume the run's newest one without being told where. The API server always sets a
    uid; without one the engine falls back to what it did before run ids were sent."""
    uid = meta.get("uid")
    if isinstance(uid, str) and uid:
        return uid
    log.warning(
        "%s/%s has no metadata.uid: binding it without a runId",
        meta.get("namespace", "default"),
        meta.get("name"),
    )
    return None


def _resumed(requested: str | None, requested_step: int | None, engine: Mapping[str, Any]) -> str:
    """Where a bound experiment starts: the engine may resume from a newer checkpoint of
    the same run than the one requested (one written on SIGTERM), or, with none requested,
    from the run's newest checkpoint; it says which."""
    got = engine.get("checkpoint") or {}
    if not requested:
        if got.get("step") is None:
            return "from the start"
        return f"resumed from step {got['step']}, its run's newest checkpoint: {got.get('path')}"
    if got.get("step") is None:
        return f"resuming from {requested}"
    path = got.get("path") or requested
    asked = "" if path == requested else f", requested step {requested_step}"
    return f"resumed from step {got['step']}{asked}: {path}"


def _deleting_until(pod: Mapping[str, Any]) -> float | None:
    """A deleted pod's deletionTimestamp (the API server sets it to the deletion time plus
    the grace period); an unreadable one counts as already passed."""
    stamp = pod.get("metadata", {}).get("deletionTimestamp")
    if not stamp:
        return None
    return parse_time(stamp) or 0.0


def _suffix() -> str:
    return "".join(random.choices(string.ascii_lowercase + string.digits, k=5))


class PoolReconciler:
    """Runs rounds for pools; holds only soft state (timers), never the truth."""

    def __init__(
        self,
        kube: Kube,
        engines: EngineClient,
        config: Config,
        emit: EventSink = kopf_event,
        heartbeats: m.Heartbeats | None = None,
    ) -> None:
        self.kube = kube
        self.engines = engines
        self.config = config
        self.emit = emit
        self.heartbeats = heartbeats or m.Heartbeats()
        self._idle_since: dict[str, dict[str, float]] = {}
        self._last_write: dict[str, float] = {}

    # -- observe --

    async def token(self, pool: Mapping[str, Any]) -> str | None:
        ref = pool.get("spec", {}).get("tokenSecretRef", {})
        return await self.kube.secret_value(
            manifests.engine_namespace(pool), ref.get("name", ""), ref.get("key", "token")
        )

    async def engine_views(self, pool: Mapping[str, Any], token: str | None) -> list[EngineView]:
        namespace = manifests.engine_namespace(pool)
        pods = await self.kube.list(
            PODS, namespace, labels={manifests.POOL_LABEL: pool["metadata"]["name"]}
        )
        views = [
            EngineView(
                name=p["metadata"]["name"],
                url=manifests.engine_url(p),
                node=p.get("spec", {}).get("nodeName"),
                pod_ready=manifests.is_pod_ready(p),
                pod_phase=p.get("status", {}).get("phase"),
                deleting_until=_deleting_until(p),
            )
            for p in pods
        ]
        await asyncio.gather(*(self._probe(v, token, namespace) for v in views))
        return views

    async def _probe(self, view: EngineView, token: str | None, namespace: str) -> None:
        if not (view.pod_ready and view.url and token) or view.terminating:
            return  # a deleted engine takes no work and is not asked what it runs
        try:
            cap, listed = await asyncio.gather(
                self.engines.capacity(view.url, token), self.engines.list(view.url, token)
            )
        except (EngineUnreachable, EngineError) as e:
            log.warning("engine %s: %s", view.name, e)
            await self._recheck_deletion(view, namespace)
            return
        view.capacity = cap
        view.experiments = {s["id"]: s for s in listed}
        view.reachable = True

    async def _recheck_deletion(self, view: EngineView, namespace: str) -> None:
        """An engine stops answering on SIGTERM, which may come after the pod list: re-read
        the pod, so that an engine deleted meanwhile is seen draining, not lost."""
        try:
            pod = await self.kube.get(PODS, view.name, namespace)
        except KubeError as e:
            log.warning("engine pod %s: %s", view.name, e)
            return
        if pod is not None:
            view.deleting_until = _deleting_until(pod)

    async def observe(self, pool_name: str) -> tuple[Snapshot, str | None] | None:
        pool = await self.kube.get(POOLS, pool_name)
        if pool is None:
            return None
        token = await self.token(pool)
        exps, views = await asyncio.gather(self._experiments(), self.engine_views(pool, token))
        exps = [x for x in exps if x.get("spec", {}).get("enginePool") == pool_name]
        ns_labels: dict[str, dict[str, str]] = {}
        if pool.get("spec", {}).get("namespaceSelector") is not None:
            for ns in {x["metadata"].get("namespace", "default") for x in exps}:
                obj = await self.kube.get(NAMESPACES, ns)
                ns_labels[ns] = (obj or {}).get("metadata", {}).get("labels") or {}
        snap = Snapshot(
            pool=pool,
            experiments=exps,
            engines=views,
            namespace_labels=ns_labels,
            now=time.time(),
            idle_since=self._idle_since.get(pool_name, {}),
        )
        return snap, token

    async def _experiments(self) -> list[dict[str, Any]]:
        if not self.config.namespaces:  # cluster-wide RBAC: one list
            items = await self.kube.list(EXPERIMENTS)
        else:  # namespaced RBAC: one list per watched namespace
            lists = await asyncio.gather(
                *(self.kube.list(EXPERIMENTS, ns) for ns in self.config.namespaces)
            )
            items = [x for xs in lists for x in xs]
        for x in items:  # list items may lack kind/apiVersion; Events need them
            x.setdefault("apiVersion", f"{EXPERIMENTS.group}/{EXPERIMENTS.version}")
            x.setdefault("kind", "LoRAExperiment")
        return items

    # -- the round --

    async def reconcile(self, pool_name: str) -> RoundPlan | None:
        observed = await self.observe(pool_name)
        if observed is None:
            m.forget_pool(pool_name)
            self.heartbeats.forget(pool_name)
            return None
        snap, token = observed
        plan = plan_round(snap, self.config)
        self._idle_since[pool_name] = plan.idle_since
        await self.act(snap, plan, token or "")
        self.heartbeats.beat(pool_name)
        return plan

    async def act(self, snap: Snapshot, plan: RoundPlan, token: str) -> None:
        pool = snap.pool
        pool_name = pool["metadata"]["name"]
        await asyncio.gather(*(self._unload(plan, u, token, pool_name) for u in plan.unloads))
        await asyncio.gather(*(self._put(plan, p, token, pool_name) for p in plan.puts))
        await self._pods(pool, plan)

        now = datetime.now(UTC)
        phases: dict[str, int] = {}
        series: list[m.ExperimentState] = []
        writes = []
        for w in plan.work.values():
            admission_events(w)
            new = derive(w, self.config, now)
            phases[new["phase"]] = phases.get(new["phase"], 0) + 1
            series.append(experiment_state(w.obj, new))
            old = w.obj.get("status") or {}
            self._terminal_event(w, old, new)
            changed = status_changes(old, new)
            if changed and self._should_write(w.key, changed):
                writes.append(self._write(w, new))
            for type_, reason, message in w.events:
                if type_ == WARNING:
                    log.warning("%s: %s: %s", w.key, reason, message)
                self.emit(w.obj, type_, reason, message)
        if plan.recoveries:
            m.RECOVERIES.labels(pool=pool_name).inc(plan.recoveries)
        m.set_experiments(pool_name, series)
        await asyncio.gather(*writes)
        # Deleted experiments leave the plan: forget their write times, or the map grows
        # with every experiment the pool ever ran.
        for key in self._last_write.keys() - plan.work.keys():
            del self._last_write[key]
        await self._pool_status(snap, plan, phases, now)

    def _should_write(self, key: str, changed: set[str]) -> bool:
        if changed - PROGRESS_FIELDS:
            return True
        last = self._last_write.get(key, 0.0)
        return time.monotonic() - last >= self.config.status_interval

    async def _write(self, w: Work, status: dict[str, Any]) -> None:
        meta = w.obj["metadata"]
        try:
            await self.kube.patch(
                EXPERIMENTS,
                meta["name"],
                {"status": status},
                namespace=meta.get("namespace"),
                subresource="status",
            )
            self._last_write[w.key] = time.monotonic()
        except KubeError as e:
            m.RECONCILE_ERRORS.labels(kind="status").inc()
            log.warning("status of %s: %s", w.key, e)

    @staticmethod
    def _terminal_event(w: Work, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
        if new["phase"] != old.get("phase") and new["phase"] in st.TERMINAL:
            type_ = NORMAL if new["phase"] == st.SUCCEEDED else WARNING
            w.event(type_, new["phase"], new.get("message", ""))

    async def _unload(self, plan: RoundPlan, u: Unload, token: str, pool_name: str) -> None:
        try:
            final = await self.engines.delete(u.url, token, u.exp_id)
        except (EngineUnreachable, EngineError) as e:
            m.RECONCILE_ERRORS.labels(kind="unload").inc()
            log.warning("unload %s from %s (%s): %s", u.exp_id, u.engine, u.reason, e)
            return
        log.info("unloaded %s from %s (%s)", u.exp_id, u.engine, u.reason)
        w = plan.work.get(u.key) if u.key else None
        if w is None or u.reason == DUPLICATE:
            return
        if final:
            merged = dict(w.engine_status or {})
            merged.update({k: v for k, v in final.items() if v is not None})
            if u.reason in (SUSPEND, PREEMPT):
                merged["phase"] = st.RUNNING  # unloaded, not finished
            w.engine_status = merged
        step = (final or {}).get("checkpoint", {}) or {}
        at = f"checkpoint at step {step.get('step')}" if step else "no checkpoint"
        if u.reason == SUSPEND:
            w.binding = None
            w.event(NORMAL, "Suspended", f"unloaded from engine {u.engine}; {at}")
        elif u.reason == PREEMPT:
            w.binding = None
            w.waiting_reason = "Preempted"
            m.PREEMPTIONS.labels(pool=pool_name).inc()
            w.event(
                NORMAL,
                "Preempted",
                f"unloaded from engine {u.engine} for higher-priority {u.for_key}; {at}",
            )

    async def _put(self, plan: RoundPlan, p: Put, token: str, pool_name: str) -> None:
        w = plan.work[p.key]
        try:
            code, body = await self._engine_put(p, token)
        except EngineUnreachable as e:
            log.warning("bind %s to %s: %s", p.key, p.engine, e)
            w.waiting_reason = placement.WAIT_STARTING
            return
        except EngineError as e:
            if e.code in ("no_capacity", "conflict") or e.status >= 500:
                w.waiting_reason = placement.WAIT_NO_CAPACITY
                log.warning("bind %s to %s: %s", p.key, p.engine, e)
                return
            field_ = e.field or "spec"
            w.engine_status = {"phase": st.FAILED, "error": f"{field_}: {e.message}"}
            w.event(WARNING, "EngineRejected", f"engine {p.engine} rejected it: {field_}: {e}")
            return
        log.info("bound %s to %s (%s, resumeFrom=%s)", p.key, p.engine, code, p.body["resumeFrom"])
        w.binding = st.Binding(p.engine, p.node)
        w.engine_status = body
        m.PLACEMENTS.labels(pool=pool_name).inc()
        since = self._pending_since(w.obj)
        if since is not None:
            m.SCHEDULING_LATENCY.labels(pool=pool_name).observe(max(time.time() - since, 0.0))
        how = _resumed(p.body["resumeFrom"], _checkpoint_step(w.obj), body)
        w.event(NORMAL, "Bound", f"bound to engine {p.engine} ({how})")

    async def _engine_put(self, p: Put, token: str) -> tuple[int, dict[str, Any]]:
        args = (p.url, token, p.exp_id, p.body["spec"], p.body["namespace"], p.body["name"])
        run_id = p.body.get("runId")
        try:
            return await self.engines.put(*args, p.body["resumeFrom"], run_id)
        except EngineError as e:
            if run_id is None or e.field != "runId":
                raise
            # An engine from before run ids refuses the field (422 "unknown field"): bind
            # without it, as before, rather than fail the experiment during an upgrade.
            log.warning("bind %s to %s: %s; binding without runId", p.key, p.engine, e)
            return await self.engines.put(*args, p.body["resumeFrom"], None)

    @staticmethod
    def _pending_since(obj: Mapping[str, Any]) -> float | None:
        cond = st.get_condition((obj.get("status") or {}).get("conditions"), st.COND_SCHEDULED)
        if cond is not None and cond.get("status") == "False":
            return parse_time(cond.get("lastTransitionTime"))
        return parse_time(obj["metadata"].get("creationTimestamp"))

    async def _pods(self, pool: Mapping[str, Any], plan: RoundPlan) -> None:
        ns = manifests.engine_namespace(pool)
        pool_obj = {"apiVersion": manifests.API_VERSION, "kind": "EnginePool", **pool}
        for _ in range(plan.create_pods):
            pod = manifests.engine_pod(pool, _suffix())
            try:
                await self.kube.create(PODS, pod, ns)
                log.info("created engine pod %s/%s", ns, pod["metadata"]["name"])
                self.emit(
                    pool_obj, NORMAL, "EngineCreated", f"engine pod {pod['metadata']['name']}"
                )
            except KubeError as e:
                m.RECONCILE_ERRORS.labels(kind="pod").inc()
                log.warning("create engine pod: %s", e)
        for name in plan.delete_pods:
            try:
                await self.kube.delete(PODS, name, ns)
                log.info("deleted engine pod %s/%s", ns, name)
                self.emit(pool_obj, NORMAL, "EngineRemoved", f"engine pod {name} (idle or dead)")
            except KubeError as e:
                m.RECONCILE_ERRORS.labels(kind="pod").inc()
                log.warning("delete engine pod %s: %s", name, e)

    async def _pool_status(
        self, snap: Snapshot, plan: RoundPlan, phases: dict[str, int], now: datetime
    ) -> None:
        pool = snap.pool
        name = pool["metadata"]["name"]
        live = _live(snap.engines)
        ready = [e for e in live if e.usable]
        used = sum(int((e.capacity or {}).get("usedSlots", len(e.experiments))) for e in ready)
        total = sum(int((e.capacity or {}).get("maxAdapters", 0)) for e in ready)
        m.set_pool(name, phases, len(live), used, max(total - used, 0))
        old = pool.get("status") or {}
        new = st.pool_status(
            engines=len(live),
            ready=len(ready),
            slots_used=used,
            slots_free=max(total - used, 0),
            generation=int(pool["metadata"].get("generation", 0)),
            old_conditions=old.get("conditions"),
            now=now,
        )
        if status_changes(old, new):
            try:
                await self.kube.patch(POOLS, name, {"status": new}, subresource="status")
            except KubeError as e:
                m.RECONCILE_ERRORS.labels(kind="status").inc()
                log.warning("pool status %s: %s", name, e)

    # -- deletion --

    async def release(self, obj: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Unload a deleted experiment from every engine of its pool (checkpoints stay)."""
        pool_name = obj.get("spec", {}).get("enginePool", "")
        pool = await self.kube.get(POOLS, pool_name)
        if pool is None:
            return []
        token = await self.token(pool) or ""
        meta = obj["metadata"]
        exp_id = experiment_id(meta.get("namespace", "default"), meta["name"])
        finals = []
        for view in await self.engine_views(pool, token):
            if exp_id in view.experiments and view.url:
                final = await self.engines.delete(view.url, token, exp_id)
                if final:
                    finals.append({"engine": view.name, **final})
        return finals

    async def pool_deleted(self, pool_name: str) -> None:
        """The pool is going away (its engines with it): its experiments go Pending with
        `Admitted=False` naming spec.enginePool; a pool of that name created later admits
        them again, and they resume from their recorded checkpoints."""
        m.forget_pool(pool_name)
        self.heartbeats.forget(pool_name)
        self._idle_since.pop(pool_name, None)
        now = datetime.now(UTC)
        for obj in await self._experiments():
            if obj.get("spec", {}).get("enginePool") != pool_name:
                continue
            if _deleting(obj) or _phase(obj) in st.TERMINAL:
                continue
            w = Work(obj=obj, restarts=int((obj.get("status") or {}).get("restarts", 0)))
            w.problems = [f"spec.enginePool: EnginePool {pool_name!r} was deleted"]
            admission_events(w)
            new = derive(w, self.config, now)
            if status_changes(obj.get("status") or {}, new):
                await self._write(w, new)
            for type_, reason, message in w.events:
                self.emit(w.obj, type_, reason, message)

    async def admit_orphan(self, obj: Mapping[str, Any]) -> bool:
        """An experiment whose pool does not exist: Pending, Admitted=False, an Event.

        Returns True when the pool exists (the pool's reconciler takes over).
        """
        pool_name = obj.get("spec", {}).get("enginePool", "")
        if await self.kube.get(POOLS, pool_name) is not None:
            return True
        if _deleting(obj) or _phase(obj) in st.TERMINAL:
            return False
        w = Work(obj=dict(obj), restarts=int((obj.get("status") or {}).get("restarts", 0)))
        w.problems = [str(p) for p in admission.check_experiment(obj, None)]
        admission_events(w)
        new = derive(w, self.config, datetime.now(UTC))
        if status_changes(obj.get("status") or {}, new):
            await self._write(w, new)
        for type_, reason, message in w.events:
            self.emit(w.obj, type_, reason, message)
        return False
