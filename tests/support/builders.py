"""Small builders so operator tests read like specs (after Kueue's testing wrappers).

experiment("a").rank(16).priority_class("high").obj()
pool("pool-a").max_rank(32).slots(4).replicas(0, 2).obj()
engine("e1").slots(4, used=1).running(run("x", priority=1)).build()
pending("a").rank(16).priority(5).created(10).build()
"""

from __future__ import annotations

import copy
from typing import Any, Self

from loraplex_operator import manifests
from loraplex_operator.api.pool import EnginePoolSpec
from loraplex_operator.placement import Engine, PendingExperiment, PoolLimits, RunningExperiment
from loraplex_operator.resources import Pool


class ExperimentWrapper:
    def __init__(self, name: str, namespace: str = "team-a") -> None:
        self._obj: dict[str, Any] = {
            "apiVersion": "loraplex.dev/v1alpha1",
            "kind": "LoRAExperiment",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": f"uid-{namespace}-{name}",
                "generation": 1,
            },
            "spec": {
                "enginePool": "pool-a",
                "task": {"name": "target-token", "params": {"target": "yes"}},
            },
        }

    @property
    def _spec(self) -> dict[str, Any]:
        return self._obj["spec"]

    def _sub(self, key: str) -> dict[str, Any]:
        return self._spec.setdefault(key, {})

    def namespace(self, ns: str) -> Self:
        self._obj["metadata"]["namespace"] = ns
        return self

    def generation(self, g: int) -> Self:
        self._obj["metadata"]["generation"] = g
        return self

    def pool(self, name: str) -> Self:
        self._spec["enginePool"] = name
        return self

    def rank(self, r: int) -> Self:
        self._sub("lora")["rank"] = r
        return self

    def alpha(self, a: float) -> Self:
        self._sub("lora")["alpha"] = a
        return self

    def dropout(self, d: float) -> Self:
        self._sub("lora")["dropout"] = d
        return self

    def modules(self, *names: str) -> Self:
        self._sub("lora")["targetModules"] = list(names)
        return self

    def task(self, name: str, **fields: Any) -> Self:
        self._spec["task"] = {"name": name, **fields}
        return self

    def client(self, model_id: str | None = None, **fields: Any) -> Self:
        """A client-driven experiment (spec.client, no task): what the gateway creates;
        its model id by default one its name may hold (client_ids.py)."""
        self._spec.pop("task", None)
        model_id = model_id or f"{self._obj['metadata']['name']}:train:0"
        self._spec["client"] = {"modelId": model_id, **fields}
        return self

    def reward(self, reward: str, url: str | None = None) -> Self:
        self._spec["task"]["reward"] = reward
        if url is not None:
            self._spec["task"]["rewardUrl"] = url
        return self

    def algorithm(self, **fields: Any) -> Self:
        self._sub("algorithm").update(fields)
        return self

    def rollout(self, **fields: Any) -> Self:
        self._sub("rollout").update(fields)
        return self

    def checkpoint(self, **fields: Any) -> Self:
        self._sub("checkpoint").update(fields)
        return self

    def priority(self, p: int) -> Self:
        """The retired raw spec.priority (refused unless 0)."""
        self._spec["priority"] = p
        return self

    def priority_class(self, name: str) -> Self:
        self._spec["priorityClassName"] = name
        return self

    def suspend(self, value: bool = True) -> Self:
        self._spec["suspend"] = value
        return self

    def status(self, **fields: Any) -> Self:
        self._obj.setdefault("status", {}).update(fields)
        return self

    def set(self, dotted: str, value: Any) -> Self:
        """Escape hatch: set any field by a dotted path, e.g. set("spec.task.params", {})."""
        *parents, leaf = dotted.split(".")
        node = self._obj
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
        return self

    def obj(self) -> dict[str, Any]:
        return copy.deepcopy(self._obj)


class PoolWrapper:
    def __init__(self, name: str) -> None:
        self._obj: dict[str, Any] = {
            "apiVersion": "loraplex.dev/v1alpha1",
            "kind": "EnginePool",
            "metadata": {"name": name, "uid": f"uid-{name}", "generation": 1},
            "spec": {
                "baseModel": "/models/tiny-llama",
                "template": {"image": "ghcr.io/loraplex/engine-cpu:0.1.0"},
                "tokenSecretRef": {"name": "engine-token"},
            },
        }

    @property
    def _spec(self) -> dict[str, Any]:
        return self._obj["spec"]

    def backend(self, b: str) -> Self:
        self._spec["rolloutBackend"] = b
        return self

    def slots(self, n: int) -> Self:
        self._spec.setdefault("capacity", {})["maxAdapters"] = n
        return self

    def max_rank(self, r: int) -> Self:
        self._spec.setdefault("capacity", {})["maxRank"] = r
        return self

    def memory(self, n: int) -> Self:
        self._spec.setdefault("capacity", {})["memoryBytes"] = n
        return self

    def model_shape(self, **fields: int) -> Self:
        self._spec["modelShape"] = dict(fields)
        return self

    def replicas(self, lo: int, hi: int) -> Self:
        self._spec["replicas"] = {"min": lo, "max": hi}
        return self

    def gpus(self, n: int) -> Self:
        """spec.gpusPerEngine: ranks per engine (GPUs on a GPU pool)."""
        self._spec["gpusPerEngine"] = n
        return self

    def shard_base(self, on: bool = True) -> Self:
        """spec.shardBase: the frozen base sharded over the engine's ranks."""
        self._spec["shardBase"] = on
        return self

    def checkpoint(self, root: str | None = None, volume: dict[str, Any] | None = None) -> Self:
        ckpt = self._spec.setdefault("checkpoint", {})
        if root is not None:
            ckpt["root"] = root
        if volume is not None:
            ckpt["volume"] = volume
        return self

    def template(self, **fields: Any) -> Self:
        self._spec["template"].update(fields)
        return self

    def priority_class(
        self, name: str, value: int, *namespaces: str, cross: bool | None = None
    ) -> Self:
        """A spec.priorityClasses entry; `namespaces` empty = every namespace, `cross` is
        preemptOtherNamespaces (None: left to the default)."""
        entry: dict[str, Any] = {"name": name, "value": value}
        if namespaces:
            entry["namespaces"] = list(namespaces)
        if cross is not None:
            entry["preemptOtherNamespaces"] = cross
        self._spec.setdefault("priorityClasses", []).append(entry)
        return self

    def allowed_namespaces(self, *names: str) -> Self:
        self._spec["allowedNamespaces"] = list(names)
        return self

    def namespace_selector(self, selector: dict[str, Any]) -> Self:
        self._spec["namespaceSelector"] = selector
        return self

    def target_modules(self, *names: str) -> Self:
        self._spec["allowedTargetModules"] = list(names)
        return self

    def set(self, dotted: str, value: Any) -> Self:
        *parents, leaf = dotted.split(".")
        node = self._obj
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
        return self

    def obj(self) -> dict[str, Any]:
        return copy.deepcopy(self._obj)


def experiment(name: str, namespace: str = "team-a") -> ExperimentWrapper:
    return ExperimentWrapper(name, namespace)


def pool(name: str = "pool-a") -> PoolWrapper:
    return PoolWrapper(name)


# --- placement inputs ------------------------------------------------------------------


class PendingWrapper:
    def __init__(self, key: str) -> None:
        self._f: dict[str, Any] = {
            "key": key,
            "priority": 0,
            "created": 0.0,
            "rank": 8,
            "memory_bytes": 0,
            "preempts_other_namespaces": False,
        }

    def rank(self, r: int) -> Self:
        self._f["rank"] = r
        return self

    def priority(self, p: int) -> Self:
        self._f["priority"] = p
        return self

    def created(self, t: float) -> Self:
        self._f["created"] = t
        return self

    def memory(self, n: int) -> Self:
        self._f["memory_bytes"] = n
        return self

    def cross(self, on: bool = True) -> Self:
        """Its priority class has preemptOtherNamespaces."""
        self._f["preempts_other_namespaces"] = on
        return self

    def build(self) -> PendingExperiment:
        return PendingExperiment(**self._f)


class EngineWrapper:
    def __init__(self, name: str) -> None:
        self._f: dict[str, Any] = {
            "name": name, "ready": True, "slots_total": 4, "slots_used": 0, "max_rank": 64,
            "memory_budget": 0, "memory_used": 0, "running": (),
        }  # fmt: skip

    def slots(self, total: int, used: int = 0) -> Self:
        self._f.update(slots_total=total, slots_used=used)
        return self

    def max_rank(self, r: int) -> Self:
        self._f["max_rank"] = r
        return self

    def memory(self, budget: int, used: int = 0) -> Self:
        self._f.update(memory_budget=budget, memory_used=used)
        return self

    def not_ready(self) -> Self:
        self._f["ready"] = False
        return self

    def running(self, *runs: RunningExperiment) -> Self:
        """Running experiments; they occupy slots (and memory) on top of `slots(used=)`."""
        self._f["running"] = tuple(runs)
        self._f["slots_used"] += len(runs)
        self._f["memory_used"] += sum(r.memory_bytes for r in runs)
        return self

    def build(self) -> Engine:
        return Engine(**self._f)


def pending(key: str) -> PendingWrapper:
    return PendingWrapper(key)


def engine(name: str) -> EngineWrapper:
    return EngineWrapper(name)


def run(
    key: str, priority: int = 0, rank: int = 8, memory: int = 0, started: float = 0.0
) -> RunningExperiment:
    return RunningExperiment(
        key=key, priority=priority, rank=rank, memory_bytes=memory, started=started
    )


def limits(
    max_replicas: int = 0, current: int = 0, slots: int = 4, max_rank: int = 64, memory: int = 0
) -> PoolLimits:
    return PoolLimits(
        max_replicas=max_replicas, current_replicas=current, slots_per_engine=slots,
        max_rank=max_rank, memory_budget=memory,
    )  # fmt: skip


# The engine pod manifests of raw pool objects (the operator reads each pool once, typed).
def pod_of(pool_obj: dict[str, Any], suffix: str = "x") -> dict[str, Any]:
    return manifests.engine_pod(Pool.from_obj(pool_obj), suffix)


def serve_args(spec: dict[str, Any]) -> list[str]:
    return manifests.engine_args(EnginePoolSpec.from_obj(spec))


def pod_resources(spec: dict[str, Any]) -> dict[str, Any]:
    return manifests.engine_resources(EnginePoolSpec.from_obj(spec))
