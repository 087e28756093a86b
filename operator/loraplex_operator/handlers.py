"""kopf registrations: thin and idempotent; the work lives in `reconcile.py`.

- one daemon per EnginePool runs reconcile rounds (every `LORAPLEX_RECONCILE_INTERVAL`
  seconds, or at once when woken by an experiment change);
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

from loraplex_operator import metrics as m
from loraplex_operator.config import Config
from loraplex_operator.engine_client import EngineClient, EngineError, EngineUnreachable
from loraplex_operator.kube import EXPERIMENTS, POOLS, Kube
from loraplex_operator.reconcile import PoolReconciler
from loraplex_operator.resources import API_VERSION, FINALIZER

log = logging.getLogger("loraplex_operator")


def _raw(body: Any) -> dict[str, Any]:
    obj = copy.deepcopy(dict(body))
    obj.setdefault("apiVersion", API_VERSION)
    return obj


def _wake(memo: Any, pool: str | None) -> None:
    if pool and getattr(memo, "wake", None) is not None:
        memo.wake.setdefault(pool, asyncio.Event()).set()


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.INFO
    settings.watching.reconnect_backoff = 1.0
    config = Config.from_env(os.environ)
    kube = Kube.from_environment(settings)
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
    hb: m.Heartbeats = memo.reconciler.heartbeats
    return {"stale": hb.stale(max(60.0, 10 * memo.config.interval))}


@kopf.daemon(
    *POOLS.kopf_resource, cancellation_backoff=15.0, cancellation_timeout=30.0, initial_delay=0
)
async def pool_reconciler(name: str, stopped: Any, memo: Any, logger: Any, **_: Any) -> None:
    """One reconciler per pool: rounds until the pool is deleted or the operator stops."""
    wake = memo.wake.setdefault(name, asyncio.Event())
    interval = memo.config.interval
    while not stopped:
        wake.clear()
        try:
            await memo.reconciler.reconcile(name)
        except Exception:
            m.RECONCILE_ERRORS.labels(kind="pool").inc()
            logger.exception("reconcile round of pool %s failed", name)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), timeout=interval)
    memo.wake.pop(name, None)
    reason = getattr(stopped, "reason", None)
    if reason is not None and kopf.DaemonStoppingReason.RESOURCE_DELETED in reason:
        logger.info("pool %s deleted: its experiments go back to Pending", name)
        await memo.reconciler.pool_deleted(name)


async def _experiment_changed(body: Any, spec: Any, memo: Any) -> None:
    try:
        exists = await memo.reconciler.admit_orphan(_raw(body))
    except Exception:
        m.RECONCILE_ERRORS.labels(kind="experiment").inc()
        raise
    if exists:
        _wake(memo, spec.get("enginePool"))


@kopf.on.create(*EXPERIMENTS.kopf_resource, id="admit")
async def experiment_created(body: Any, spec: Any, memo: Any, **_: Any) -> None:
    await _experiment_changed(body, spec, memo)


@kopf.on.resume(*EXPERIMENTS.kopf_resource, id="admit")
async def experiment_resumed(body: Any, spec: Any, memo: Any, **_: Any) -> None:
    await _experiment_changed(body, spec, memo)


@kopf.on.update(*EXPERIMENTS.kopf_resource, id="admit-update", field="spec")
async def experiment_updated(body: Any, spec: Any, memo: Any, **_: Any) -> None:
    await _experiment_changed(body, spec, memo)


@kopf.on.delete(*EXPERIMENTS.kopf_resource, id="release")
async def experiment_deleted(body: Any, spec: Any, memo: Any, logger: Any, **_: Any) -> None:
    """Checkpoint and unload from the engine; the checkpoint stays on shared storage."""
    obj = _raw(body)
    try:
        finals = await memo.reconciler.release(obj)
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
