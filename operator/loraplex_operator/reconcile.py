"""The level-based pool reconciler: one round = observe, plan, act (the I/O half).

Every round for one EnginePool:

1. **observe** (`PoolReconciler.observe`): the pool, every LoRAExperiment naming it, the
   pool's engine Pods (from a `sources.ClusterSource`: kopf's indexes in the operator),
   and — from every ready engine — what it actually runs (`GET /v1/capacity`,
   `GET /v1/experiments`), as an `observation.Snapshot`;
2. **plan** (`planning.plan_round`, pure): adopt, recover, unload, admit, place, scale;
3. **act** (`PoolReconciler.act`): unloads and preemptions (`DELETE` = checkpoint +
   unload), binds (`PUT`, idempotent), Pod creates/deletes, then each experiment's
   status and Events through `publish.StatusPublisher`, and the metrics.

Because each round starts from what the engines say, a restarted operator re-derives
everything: an experiment an engine runs is adopted, never bound a second time; one
that no engine runs but whose status names an engine is recovered from its checkpoint.
The reconciler holds only soft state (timers), never the truth.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import string
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from loraplex_operator import admission, manifests, placement
from loraplex_operator import metrics as m
from loraplex_operator import status as st
from loraplex_operator.backoffs import (
    PUT_ATTEMPTS,
    WAIT_ENGINE_ERROR,
    PutBackoff,
    RecreateBackoff,
)
from loraplex_operator.config import Config
from loraplex_operator.engine_client import EngineClient, EngineError, EngineUnreachable
from loraplex_operator.kube import NAMESPACES, PODS, SECRETS, Kube, KubeError
from loraplex_operator.observation import (
    EngineView,
    Snapshot,
    deleting_until,
    failures,
    pool_observation,
)
from loraplex_operator.planning import plan_round
from loraplex_operator.publish import EventSink, StatusPublisher, experiment_state, kopf_event
from loraplex_operator.resources import API_VERSION, POOL_KIND, Experiment, Pool, parse_time
from loraplex_operator.round_plan import (
    DUPLICATE,
    IDLE,
    NORMAL,
    PREEMPT,
    SUSPEND,
    WARNING,
    Put,
    RoundPlan,
    Unload,
    Work,
)
from loraplex_operator.sources import ClusterSource, ListedCluster
from loraplex_operator.versions import push_publish

log = logging.getLogger("loraplex_operator.reconcile")

# How long a read of the token Secret or of a namespace's labels is reused: neither is
# watched (the operator may only `get` them), and a round must not read them each time.
READ_TTL = 60.0


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
        self.engines = engines
        self.config = config
        self.heartbeats = heartbeats or m.Heartbeats()
        self.publisher = StatusPublisher(kube, emit, config)
        self._idle_since: dict[str, dict[str, float]] = {}
        self._reads: dict[tuple[str, ...], tuple[float, Any]] = {}  # key -> (expiry, value)
        self.put_backoff: dict[str, PutBackoff] = {}  # per pool
        self.recreate: dict[str, RecreateBackoff] = {}  # per pool
        self._failures_told: dict[str, set[tuple[str, str]]] = {}  # pool -> (pod, reason)

    @property
    def kube(self) -> Kube:
        return self.publisher.kube

    @kube.setter
    def kube(self, kube: Kube) -> None:
        self.publisher.kube = kube

    @property
    def emit(self) -> EventSink:
        return self.publisher.emit

    # -- observe --

    def source(self) -> ClusterSource:
        """Reads through the API (rounds run outside kopf, as in the tests)."""
        return ListedCluster(self.kube, self.config)

    async def _cached(self, key: tuple[str, ...], read: Any) -> Any:
        now = time.monotonic()
        hit = self._reads.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        value = await read()
        self._reads[key] = (now + READ_TTL, value)
        return value

    async def token(self, pool: Pool) -> str | None:
        secret = pool.spec.token_secret_ref
        ns = pool.spec.engine_namespace

        async def read() -> str | None:
            value = await self.kube.secret_value(ns, secret.name, secret.key)
            if value is None and self.config.managed_token == f"{ns}/{secret.name}":
                value = await self._create_token(ns, secret.name, secret.key)
            return value

        return await self._cached(("secret", ns, secret.name, secret.key), read)

    async def _create_token(self, ns: str, name: str, key: str) -> str | None:
        """The chart's engine token, absent: create it (a conflict means another writer
        did first: read theirs)."""
        token = secrets.token_urlsafe(self.config.token_length)[: self.config.token_length]
        try:
            await self.kube.create(SECRETS, manifests.token_secret(ns, name, key, token), ns)
        except KubeError as e:
            if e.status != 409:
                log.warning("create engine token Secret %s/%s: %s", ns, name, e)
                return None
            return await self.kube.secret_value(ns, name, key)
        log.info("created engine token Secret %s/%s", ns, name)
        return token

    async def namespace_labels(self, namespace: str) -> dict[str, str]:
        async def read() -> dict[str, str]:
            obj = await self.kube.get(NAMESPACES, namespace)
            return (obj or {}).get("metadata", {}).get("labels") or {}

        return await self._cached(("namespace", namespace), read)

    async def engine_views(
        self, pool: Pool, token: str | None, source: ClusterSource
    ) -> list[EngineView]:
        namespace = pool.spec.engine_namespace
        pods = await source.engine_pods(pool.name, namespace)
        now, stall_after = time.time(), self.config.stall_after
        views = [EngineView.from_pod(p, now, stall_after) for p in pods]
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
            view.deleting_until = deleting_until(pod)

    async def observe(
        self, pool_name: str, source: ClusterSource
    ) -> tuple[Snapshot, str | None] | None:
        raw = await source.pool(pool_name)
        if raw is None:
            return None
        pool = Pool.from_obj(raw)
        token = await self.token(pool)
        items, views = await asyncio.gather(
            source.experiments(pool_name), self.engine_views(pool, token, source)
        )
        exps = [Experiment.from_obj(x) for x in items]
        ns_labels: dict[str, dict[str, str]] = {}
        if pool.spec.namespace_selector is not None:
            for ns in {x.meta.namespace for x in exps}:
                ns_labels[ns] = await self.namespace_labels(ns)
        now = time.time()
        backoff = self.recreate.setdefault(pool_name, RecreateBackoff())
        failed = [v.failure for v in views if v.dead and v.failure and not v.terminating]
        backoff.observe(failed, [v.name for v in views if v.usable], now)
        snap = Snapshot(
            pool=pool,
            experiments=exps,
            engines=views,
            namespace_labels=ns_labels,
            now=now,
            idle_since=self._idle_since.get(pool_name, {}),
            token_found=token is not None,
            recreate_held=backoff.holding(now),
        )
        return snap, token

    # -- the round --

    async def reconcile(
        self, pool_name: str, source: ClusterSource | None = None
    ) -> RoundPlan | None:
        observed = await self.observe(pool_name, source or self.source())
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
        pool_name = snap.pool.name
        await asyncio.gather(*(self._unload(plan, u, token, pool_name) for u in plan.unloads))
        await asyncio.gather(*(self._put(plan, p, token, pool_name) for p in plan.puts))
        await push_publish(self.engines, plan.work.values(), token)  # kubectl-patched aliases
        self._backoff(pool_name).keep_only(plan.work)
        await self._pods(snap.pool, plan)
        self._tell_failures(snap)

        now = datetime.now(UTC)
        works = list(plan.work.values())
        statuses = await asyncio.gather(*(self.publisher.publish(w, now) for w in works))
        phases: dict[str, int] = {}
        for status in statuses:
            phases[str(status.phase)] = phases.get(str(status.phase), 0) + 1
        if plan.recoveries:
            m.RECOVERIES.labels(pool=pool_name).inc(plan.recoveries)
        m.set_experiments(pool_name, map(experiment_state, (w.exp for w in works), statuses))
        self.publisher.forget_others(plan.work)
        await self._pool_status(snap, phases, now)

    async def _unload(self, plan: RoundPlan, u: Unload, token: str, pool_name: str) -> None:
        w = plan.work.get(u.key) if u.key else None
        if u.reason == IDLE and (
            w is None or not await self.publisher.suspend_idle(w, datetime.now(UTC))
        ):
            return
        try:
            final = await self.engines.delete(u.url, token, u.exp_id)
        except (EngineUnreachable, EngineError) as e:
            m.RECONCILE_ERRORS.labels(kind="unload").inc()
            log.warning("unload %s from %s (%s): %s", u.exp_id, u.engine, u.reason, e)
            return
        log.info("unloaded %s from %s (%s)", u.exp_id, u.engine, u.reason)
        if w is None or u.reason == DUPLICATE:
            return
        if final:
            merged = dict(w.engine_status or {})
            merged.update({k: v for k, v in final.items() if v is not None})
            if u.reason in (SUSPEND, IDLE, PREEMPT):
                merged["phase"] = st.RUNNING  # unloaded, not finished
            w.engine_status = merged
        step = (final or {}).get("checkpoint", {}) or {}
        at = f"checkpoint at step {step.get('step')}" if step else "no checkpoint"
        if u.reason in (SUSPEND, IDLE):
            w.binding = None
            why = (
                "idle past spec.client.idleSeconds (a call resumes it); "
                if u.reason == IDLE
                else ""
            )
            w.event(NORMAL, "Suspended", f"{why}unloaded from engine {u.engine}; {at}")
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
        if self._backoff(pool_name).waiting(p.key):
            w.waiting_reason = WAIT_ENGINE_ERROR
            return
        try:
            code, body = await self._engine_put(p, token)
        except EngineUnreachable as e:
            log.warning("bind %s to %s: %s", p.key, p.engine, e)
            w.waiting_reason = placement.WAIT_STARTING
            return
        except EngineError as e:
            log.warning("bind %s to %s: %s", p.key, p.engine, e)
            if e.status == 503:
                w.waiting_reason = placement.WAIT_STARTING
                return
            if e.status >= 500:
                self._put_failed(w, p, e, self._backoff(pool_name))
                return
            if e.code in ("no_capacity", "namespace_share", "conflict"):
                w.waiting_reason = placement.WAIT_NO_CAPACITY
                return
            field_ = e.field or "spec"
            w.engine_status = {"phase": st.FAILED, "error": f"{field_}: {e.message}"}
            w.event(WARNING, "EngineRejected", f"engine {p.engine} rejected it: {field_}: {e}")
            return
        log.info("bound %s to %s (%s, resumeFrom=%s)", p.key, p.engine, code, p.body["resumeFrom"])
        self._backoff(pool_name).forget(p.key)
        w.binding = st.Binding(p.engine, p.node)
        w.engine_status = body
        m.PLACEMENTS.labels(pool=pool_name).inc()
        since = _pending_since(w.exp)
        if since is not None:
            m.SCHEDULING_LATENCY.labels(pool=pool_name).observe(max(time.time() - since, 0.0))
        how = _resumed(p.body["resumeFrom"], w.exp.status.checkpoint.step, body)
        w.event(NORMAL, "Bound", f"bound to engine {p.engine} ({how})")

    def _backoff(self, pool_name: str) -> PutBackoff:
        return self.put_backoff.setdefault(pool_name, PutBackoff())

    @staticmethod
    def _put_failed(w: Work, p: Put, e: EngineError, backoff: PutBackoff) -> None:
        """An engine's 5xx: retried with back-off, PUT_ATTEMPTS at most, then Failed."""
        count = backoff.failed(p.key)
        what = f"engine {p.engine} answered {e.status} to bind {count}/{PUT_ATTEMPTS}: {e.message}"
        if count < PUT_ATTEMPTS:
            w.waiting_reason = WAIT_ENGINE_ERROR
            w.event(WARNING, "EngineError", f"{what}; retrying with back-off")
            return
        backoff.forget(p.key)
        w.engine_status = {"phase": st.FAILED, "error": what}
        w.event(WARNING, "EngineError", f"{what}; giving up")

    async def _engine_put(self, p: Put, token: str) -> tuple[int, dict[str, Any]]:
        args = (p.url, token, p.exp_id, p.body["spec"], p.body["namespace"], p.body["name"])
        return await self.engines.put(*args, p.body["resumeFrom"], p.body.get("runId"))

    async def _pods(self, pool: Pool, plan: RoundPlan) -> None:
        ns = pool.spec.engine_namespace
        pool_obj = {"apiVersion": API_VERSION, "kind": POOL_KIND, **pool.raw}
        for _ in range(plan.create_pods):
            pod = manifests.engine_pod(pool, _suffix(), self.config.engine_log_format)
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

    def _tell_failures(self, snap: Snapshot) -> None:
        """A Warning Event on the pool (and a log line) once per failing pod and reason."""
        pool_obj = {"apiVersion": API_VERSION, "kind": POOL_KIND, **snap.pool.raw}
        told = self._failures_told.setdefault(snap.pool.name, set())
        now = {(f.pod, f.reason): f for f in failures(snap)}
        for key, failure in sorted(now.items()):
            if key in told:
                continue
            backoff = self.recreate.get(snap.pool.name)
            wait = backoff.not_before - snap.now if backoff is not None else 0.0
            also = f"; next engine pod in {wait:.0f} s" if snap.recreate_held == failure else ""

            log.warning("pool %s: %s%s", snap.pool.name, failure.describe(), also)
            self.emit(pool_obj, WARNING, failure.reason, failure.describe() + also)
        told.intersection_update(now)
        told.update(now)

    async def _pool_status(self, snap: Snapshot, phases: dict[str, int], now: datetime) -> None:
        counts = pool_observation(snap)
        new = st.pool_status(counts, snap.pool.meta.generation, snap.pool.status.conditions, now)
        stalled = next((c for c in new.conditions if c.type == st.STALLED), None)
        reason = stalled.reason if stalled is not None and stalled.status == "True" else None
        m.set_pool(
            snap.pool.name, phases, counts.engines, counts.slots_used, counts.slots_free, reason
        )
        await self.publisher.publish_pool(snap.pool, new)

    # -- deletion and pools that do not exist --

    async def release(
        self, obj: Mapping[str, Any], source: ClusterSource | None = None
    ) -> list[dict[str, Any]]:
        """Unload a deleted experiment from every engine of its pool (checkpoints stay)."""
        source = source or self.source()
        exp = Experiment.from_obj(obj)
        raw = await source.pool(exp.spec.engine_pool)
        if raw is None:
            return []
        pool = Pool.from_obj(raw)
        token = await self.token(pool) or ""
        finals = []
        for view in await self.engine_views(pool, token, source):
            if exp.id in view.experiments and view.url:
                final = await self.engines.delete(view.url, token, exp.id)
                if final:
                    finals.append({"engine": view.name, **final})
        return finals

    async def pool_deleted(self, pool_name: str, source: ClusterSource | None = None) -> None:
        """The pool is going away (its engines with it): its experiments go Pending with
        `Admitted=False` naming spec.enginePool; a pool of that name created later admits
        them again, and they resume from their recorded checkpoints."""
        m.forget_pool(pool_name)
        self.heartbeats.forget(pool_name)
        self._idle_since.pop(pool_name, None)
        self.put_backoff.pop(pool_name, None)
        self.recreate.pop(pool_name, None)
        self._failures_told.pop(pool_name, None)
        now = datetime.now(UTC)
        for item in await (source or self.source()).experiments(pool_name):
            exp = Experiment.from_obj(item)
            if not _placeable(exp):
                continue
            w = Work.start(exp)
            w.problems = [f"spec.enginePool: EnginePool {pool_name!r} was deleted"]
            await self.publisher.publish(w, now)

    async def admit_orphan(
        self, obj: Mapping[str, Any], source: ClusterSource | None = None
    ) -> bool:
        """An experiment whose pool does not exist: Pending, Admitted=False, an Event.

        Returns True when the pool exists (the pool's reconciler takes over).
        """
        exp = Experiment.from_obj(dict(obj))
        if await (source or self.source()).pool(exp.spec.engine_pool) is not None:
            return True
        if not _placeable(exp):
            return False
        w = Work.start(exp)
        w.problems = [str(p) for p in admission.check_experiment(exp, None)]
        await self.publisher.publish(w, datetime.now(UTC))
        return False


def _placeable(exp: Experiment) -> bool:
    """Neither being deleted nor finished: its status still follows the pool."""
    return not exp.meta.deleting and exp.status.phase not in st.TERMINAL


def _pending_since(exp: Experiment) -> float | None:
    cond = st.get_condition(exp.status.conditions, st.COND_SCHEDULED)
    if cond is not None and cond.get("status") == "False":
        return parse_time(cond.get("lastTransitionTime"))
    return exp.meta.created


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


def _suffix() -> str:
    return "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
