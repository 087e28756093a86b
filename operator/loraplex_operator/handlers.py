"""kopf registrations: thin and idempotent; the work lives in `reconcile.py`.

- indexes (`@kopf.index`, kept by kopf's watches): pools by name, experiments by
  `spec.enginePool`, engine Pods by their pool label; rounds read these, not the API;
- one daemon per EnginePool runs reconcile rounds: at once when woken (an experiment or
  an engine Pod of the pool changed), every `LORAPLEX_RECONCILE_INTERVAL` seconds while
  its engines run or wait for work (they are polled), else every
  `LORAPLEX_RESYNC_INTERVAL` seconds as a safety net;
- login: credentials through `kube.Kube.connection_info` (kubernetes_asyncio: token
  files, exec plugins, in-cluster token refresh), asked again by kopf after a 401;
- LoRAExperiment create/resume/spec-update: admit against a missing pool (the pool's
  reconciler handles the rest) and wake the pool's daemon;
- LoRAExperiment delete (finalizer `loraplex.dev/finalizer`): unload from every engine
  of the pool (the engine checkpoints first; the checkpoint stays on disk).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
from typing import Any

import kopf

from loraplex_operator import logs
from loraplex_operator import metrics as m
from loraplex_operator.config import Config
from loraplex_operator.engine_client import EngineClient, EngineError, EngineUnreachable
from loraplex_operator.kube import EXPERIMENTS, PODS, POOLS, Kube
from loraplex_operator.manifests import POOL_LABEL
from loraplex_operator.reconcile import PoolReconciler
from loraplex_operator.resources import API_VERSION, FINALIZER
from loraplex_operator.sources import IndexedCluster, ListedCluster

log = logging.getLogger("loraplex_operator")
logs.configure(logs.log_format())  # kopf run configured its logging before importing this


def _raw(body: Any) -> dict[str, Any]:
    obj = copy.deepcopy(dict(body))
    obj.setdefault("apiVersion", API_VERSION)
    return obj


def _wake(memo: Any, pool: str | None) -> None:
    if pool and getattr(memo, "wake", None) is not None:
        memo.wake.setdefault(pool, asyncio.Event()).set()


def _kube(memo: Any) -> Kube:
    if getattr(memo, "kube", None) is None:
        memo.kube = Kube()
    return memo.kube


def _source(memo: Any, indexes: dict[str, Any]) -> IndexedCluster:
    return IndexedCluster(
        pools=indexes["pools_by_name"],
        experiments=indexes["experiments_by_pool"],
        pods=indexes.get("engine_pods_by_pool", {}),
        fallback=ListedCluster(memo.reconciler.kube, memo.config),
    )


@kopf.on.login()
async def login(memo: Any, **_: Any) -> kopf.ConnectionInfo:
    return await _kube(memo).connection_info()


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    logs.configure(logs.log_format())  # after kopf's own logging set-up
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.INFO
    settings.watching.reconnect_backoff = 1.0
    # Engine Pods only: the API server filters the watch behind the Pod index.
    settings.watching.label_selectors[PODS.plural] = POOL_LABEL
    config = Config.from_env(os.environ)
    kube = _kube(memo)
    engines = EngineClient(timeout=config.engine_timeout)
    heartbeats = m.Heartbeats()
    memo.config = config
    memo.reconciler = PoolReconciler(kube, engines, config, heartbeats=heartbeats)
    memo.wake = {}
    port = int(os.environ.get("LORAPLEX_METRICS_PORT", "8080"))
    memo.metrics_runner = None
    if port > 0:
        memo.metrics_runner = await m.serve(
            port,
            heartbeats,
            max_age=max(60.0, 10 * config.interval),
            kopf_liveness=os.environ.get("LORAPLEX_KOPF_LIVENESS") or None,
        )


@kopf.on.cleanup()
async def cleanup(memo: Any, **_: Any) -> None:
    reconciler: PoolReconciler | None = getattr(memo, "reconciler", None)
    if reconciler is not None:
        await reconciler.kube.close()
        await reconciler.engines.close()
    if getattr(memo, "metrics_runner", None) is not None:
        await memo.metrics_runner.cleanup()


@kopf.on.probe(id="reconcilers")
def probe(memo: Any, **_: Any) -> dict[str, Any]:
    """Fails while a pool's reconciler has not finished a round for 10 intervals: kopf
    answers its liveness endpoint (the chart's livenessProbe) with 500 when a probe
    handler fails. Permanent, because kopf would retry a temporary error inside the
    probe request until the kubelet gives up on it."""
    max_age = max(60.0, 10 * memo.config.interval)
    stale = memo.reconciler.heartbeats.stale(max_age)
    if stale:
        raise kopf.PermanentError(f"no reconcile round finished in {max_age:.0f} s: {stale}")
    return {"stale": []}


@kopf.index(*POOLS.kopf_resource)
def pools_by_name(name: str, body: Any, **_: Any) -> dict[str, Any]:
    return {name: _raw(body)}


@kopf.index(*EXPERIMENTS.kopf_resource)
def experiments_by_pool(body: Any, spec: Any, **_: Any) -> dict[str, Any]:
    return {spec.get("enginePool"): _raw(body)}


# kopf watches every kind in the namespaces it serves. With namespaced RBAC those are the
# tenants' namespaces, where the operator may not read Pods: no Pod index then (a round
# lists its pool's Pods in the engine namespace, `sources.IndexedCluster`).
if not Config.from_env(os.environ).namespaces:

    @kopf.index(*PODS.kopf_resource, labels={POOL_LABEL: kopf.PRESENT})
    def engine_pods_by_pool(body: Any, labels: Any, **_: Any) -> dict[str, Any]:
        return {labels[POOL_LABEL]: copy.deepcopy(dict(body))}

    @kopf.on.event(*PODS.kopf_resource, labels={POOL_LABEL: kopf.PRESENT})
    def engine_pod_event(labels: Any, memo: Any, **_: Any) -> None:
        """An engine Pod was created, became ready, is being deleted, died: act now."""
        _wake(memo, labels.get(POOL_LABEL))


@kopf.daemon(
    *POOLS.kopf_resource, cancellation_backoff=15.0, cancellation_timeout=30.0, initial_delay=0
)
async def pool_reconciler(name: str, stopped: Any, memo: Any, logger: Any, **indexes: Any) -> None:
    """One reconciler per pool: rounds until the pool is deleted or the operator stops."""
    wake = memo.wake.setdefault(name, asyncio.Event())
    source = _source(memo, indexes)
    while not stopped:
        wake.clear()
        try:
            await memo.reconciler.reconcile(name, source)
        except Exception:
            m.RECONCILE_ERRORS.labels(kind="pool").inc()
            logger.exception("reconcile round of pool %s failed", name)
        busy = source.polls_engines(name)
        timeout = memo.config.interval if busy else memo.config.resync
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), timeout=timeout)
    memo.wake.pop(name, None)
    reason = getattr(stopped, "reason", None)
    if reason is not None and kopf.DaemonStoppingReason.RESOURCE_DELETED in reason:
        logger.info("pool %s deleted: its experiments go back to Pending", name)
        await memo.reconciler.pool_deleted(name, source)


async def _experiment_changed(body: Any, spec: Any, memo: Any, indexes: Any) -> None:
    try:
        exists = await memo.reconciler.admit_orphan(_raw(body), _source(memo, indexes))
    except Exception:
        m.RECONCILE_ERRORS.labels(kind="experiment").inc()
        raise
    if exists:
        _wake(memo, spec.get("enginePool"))


@kopf.on.create(*EXPERIMENTS.kopf_resource, id="admit")
async def experiment_created(body: Any, spec: Any, memo: Any, **indexes: Any) -> None:
    await _experiment_changed(body, spec, memo, indexes)


@kopf.on.resume(*EXPERIMENTS.kopf_resource, id="admit")
async def experiment_resumed(body: Any, spec: Any, memo: Any, **indexes: Any) -> None:
    await _experiment_changed(body, spec, memo, indexes)


@kopf.on.update(*EXPERIMENTS.kopf_resource, id="admit-update", field="spec")
async def experiment_updated(body: Any, spec: Any, memo: Any, **indexes: Any) -> None:
    await _experiment_changed(body, spec, memo, indexes)


@kopf.on.delete(*EXPERIMENTS.kopf_resource, id="release")
async def experiment_deleted(body: Any, spec: Any, memo: Any, logger: Any, **indexes: Any) -> None:
    """Checkpoint and unload from the engine; the checkpoint stays on shared storage."""
    obj = _raw(body)
    try:
        finals = await memo.reconciler.release(obj, _source(memo, indexes))
    except (EngineUnreachable, EngineError) as e:
        m.RECONCILE_ERRORS.labels(kind="delete").inc()
        raise kopf.TemporaryError(f"unload failed: {e}", delay=2.0) from e
    for final in finals:
        ckpt = final.get("checkpoint") or {}
        kopf.info(
            obj,
            reason="Unloaded",
            message=f"unloaded from engine {final['engine']}; checkpoint {ckpt.get('path')} kept",
        )
    _wake(memo, spec.get("enginePool"))
