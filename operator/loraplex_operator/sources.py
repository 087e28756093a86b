"""Where a round reads the cluster from: kopf's indexes (kept by watches), else the API.

`IndexedCluster` answers from the `@kopf.index`es that `handlers.py` declares: pools by
name, experiments by `spec.enginePool`, engine Pods by their `loraplex.dev/pool` label,
so a round costs no API request to observe. `ListedCluster` LISTs (the tests' rounds
without kopf, and engine Pods under namespaced RBAC, where kopf watches only the tenants'
namespaces). Objects are plain dicts as
the API serves them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from loraplex_operator import manifests
from loraplex_operator.config import Config
from loraplex_operator.kube import EXPERIMENTS, PODS, POOLS, Kube
from loraplex_operator.resources import API_VERSION, EXPERIMENT_KIND
from loraplex_operator.status import TERMINAL


class ClusterSource(Protocol):
    async def pool(self, name: str) -> dict[str, Any] | None: ...
    async def experiments(self, pool: str) -> list[dict[str, Any]]: ...
    async def engine_pods(self, pool: str, namespace: str) -> list[dict[str, Any]]: ...


def _with_kind(items: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """List items lack kind/apiVersion; Events need them."""
    out = []
    for x in items:
        obj = dict(x)
        obj.setdefault("apiVersion", API_VERSION)
        obj.setdefault("kind", EXPERIMENT_KIND)
        out.append(obj)
    return out


class ListedCluster:
    """Reads through the API server: one GET or LIST per question."""

    def __init__(self, kube: Kube, config: Config) -> None:
        self.kube = kube
        self.config = config

    async def pool(self, name: str) -> dict[str, Any] | None:
        return await self.kube.get(POOLS, name)

    async def experiments(self, pool: str) -> list[dict[str, Any]]:
        if not self.config.namespaces:  # cluster-wide RBAC: one list
            items = await self.kube.list(EXPERIMENTS)
        else:  # namespaced RBAC: one list per watched namespace
            lists = await asyncio.gather(
                *(self.kube.list(EXPERIMENTS, ns) for ns in self.config.namespaces)
            )
            items = [x for xs in lists for x in xs]
        return _with_kind(x for x in items if (x.get("spec") or {}).get("enginePool") == pool)

    async def engine_pods(self, pool: str, namespace: str) -> list[dict[str, Any]]:
        return await self.kube.list(PODS, namespace, labels={manifests.POOL_LABEL: pool})


class IndexedCluster:
    """Reads kopf's indexes (`kopf.Index`: key -> store of values); engine Pods of a
    namespace kopf does not watch come from `fallback`."""

    def __init__(
        self,
        pools: Mapping[str, Iterable[Any]],
        experiments: Mapping[str, Iterable[Any]],
        pods: Mapping[str, Iterable[Any]],
        fallback: ListedCluster,
    ) -> None:
        self._pools = pools
        self._experiments = experiments
        self._pods = pods
        self.fallback = fallback

    async def pool(self, name: str) -> dict[str, Any] | None:
        return next(iter(self._pools.get(name, ())), None)

    async def experiments(self, pool: str) -> list[dict[str, Any]]:
        return _with_kind(self._experiments.get(pool, ()))

    def polls_engines(self, pool: str) -> bool:
        """Whether the pool's rounds have engines to poll (their progress is not watched):
        it has an engine Pod, or an experiment that is not finished."""
        if self._pods.get(pool):
            return True
        phases = ((x.get("status") or {}).get("phase") for x in self._experiments.get(pool, ()))
        return any(phase not in TERMINAL for phase in phases)

    async def engine_pods(self, pool: str, namespace: str) -> list[dict[str, Any]]:
        if self.fallback.config.namespaces:  # namespaced RBAC: no Pod index (handlers.py)
            return await self.fallback.engine_pods(pool, namespace)
        pods = self._pods.get(pool, ())
        return [p for p in pods if p.get("metadata", {}).get("namespace") == namespace]
