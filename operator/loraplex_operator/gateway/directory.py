"""What the gateway knows of the cluster: the engines (every EnginePool's ready engine
pods, their URLs and the pool's token) and the tenants' keys (labelled Secrets), read
again every ``refresh_s`` seconds, so a new engine, a rotated or revoked key, a pool's
changed namespaces take effect without a restart. A read that fails keeps the last good
view (logged). Nothing here is state the gateway could lose: every replica reads the same.

``KubeDirectory`` reads the Kubernetes API with the gateway's ServiceAccount;
``FileDirectory`` reads one JSON file (development and tests: the same view, no cluster).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from loraplex_operator import manifests
from loraplex_operator.gateway.keys import KEY_FIELD, KEY_LABEL, ROLE_LABEL, KeyTable
from loraplex_operator.gateway.routing import Engine
from loraplex_operator.gateway.served_names import names_of
from loraplex_operator.kube import EXPERIMENTS, NAMESPACES, PODS, POOLS, SECRETS, Kube, KubeError
from loraplex_operator.observation import EngineView
from loraplex_operator.resources import Pool

log = logging.getLogger("loraplex_operator.gateway.directory")

REFRESH_S = 5.0


def pool_engines(pool: Pool, pods: list[Mapping[str, Any]], token: str | None) -> list[Engine]:
    """The engines of ``pool`` a request may go to: ready, not terminating, with a URL,
    and a token to call them with."""
    if not token:
        return []
    spec = pool.spec
    names = names_of(spec)
    out = []
    for pod in pods:
        view = EngineView.from_pod(pod)
        if view.pod_ready and view.url and not view.terminating and not view.dead:
            out.append(
                Engine(
                    name=view.name,
                    pool=pool.name,
                    url=view.url,
                    token=token,
                    allowed_namespaces=spec.allowed_namespaces,
                    namespace_selector=spec.namespace_selector,
                    base_model=names[0],
                    served_names=names,
                    allowed_target_modules=spec.allowed_target_modules,
                )
            )
    return sorted(out, key=lambda e: e.name)


class Directory:
    """The current view: ``engines``, ``keys``, namespaces' labels."""

    def __init__(self, refresh_s: float = REFRESH_S) -> None:
        self.refresh_s = refresh_s
        self.engines: list[Engine] = []
        self.keys = KeyTable()
        self.namespace_labels: dict[str, dict[str, str]] = {}
        self.loaded = False
        self._task: asyncio.Task[None] | None = None

    # Tinker models as experiments (issue 29 item 3) need the Kubernetes API; a view
    # without it (FileDirectory) keeps stage 1's engine-held models.
    models_as_experiments = False

    def engine(self, name: str) -> Engine | None:
        return next((e for e in self.engines if e.name == name), None)

    async def get_experiment(self, namespace: str, name: str) -> dict[str, Any] | None:
        raise NotImplementedError

    async def create_experiment(self, obj: Mapping[str, Any]) -> bool:
        """False when it exists already (a resent create_model)."""
        raise NotImplementedError

    async def delete_experiment(self, namespace: str, name: str) -> bool:
        raise NotImplementedError

    async def patch_experiment(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        """A merge patch (the idle TTL's resume: idle.resume_patch)."""
        raise NotImplementedError

    def admitting(self, namespace: str) -> list[Engine]:
        """The engines whose pools admit ``namespace`` (where its Tinker models go)."""
        labels = self.namespace_labels.get(namespace, {})
        return [e for e in self.engines if e.admits(namespace, labels)]

    async def refresh(self) -> None:
        raise NotImplementedError

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self._refresh_logged()

    async def _refresh_logged(self) -> None:
        try:
            await self.refresh()
            self.loaded = True
        except Exception as e:  # keep the last good view, try again next round
            log.error("gateway directory not refreshed, the last view stays: %s", e)

    async def start(self) -> None:
        await self._refresh_logged()
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class KubeDirectory(Directory):
    """EnginePools, their engine pods and token Secrets, and the labelled key Secrets
    of ``key_namespaces`` (empty: every namespace), through the Kubernetes API."""

    models_as_experiments = True

    def __init__(
        self, kube: Kube, key_namespaces: tuple[str, ...] = (), refresh_s: float = REFRESH_S
    ) -> None:
        super().__init__(refresh_s)
        self.kube = kube
        self.key_namespaces = key_namespaces

    async def get_experiment(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self.kube.get(EXPERIMENTS, name, namespace)

    async def create_experiment(self, obj: Mapping[str, Any]) -> bool:
        try:
            await self.kube.create(EXPERIMENTS, obj, obj["metadata"]["namespace"])
            return True
        except KubeError as e:
            if e.status == 409:
                return False
            raise

    async def delete_experiment(self, namespace: str, name: str) -> bool:
        return await self.kube.delete(EXPERIMENTS, name, namespace)

    async def patch_experiment(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        await self.kube.patch(EXPERIMENTS, name, patch, namespace)

    async def refresh(self) -> None:
        engines: list[Engine] = []
        selectors = False
        for obj in await self.kube.list(POOLS):
            pool = Pool.from_obj(obj)
            ref, ns = pool.spec.token_secret_ref, pool.spec.engine_namespace
            token = await self.kube.secret_value(ns, ref.name, ref.key)
            pods = await self.kube.list(PODS, ns, labels={manifests.POOL_LABEL: pool.name})
            engines += pool_engines(pool, pods, token)
            selectors = selectors or pool.spec.namespace_selector is not None
        secrets: list[dict[str, Any]] = []
        selector = {KEY_LABEL: "true"}
        for ns in self.key_namespaces or (None,):
            secrets += await self.kube.list(SECRETS, ns, labels=selector)
        keys, problems = KeyTable.from_secrets(secrets)
        for p in problems:
            log.warning("API key not loaded: %s", p)
        labels: dict[str, dict[str, str]] = {}
        if selectors:  # a pool selects namespaces by label: read the tenants' labels
            for k in {s["metadata"]["namespace"] for s in secrets}:
                obj = await self.kube.get(NAMESPACES, k)
                labels[k] = dict(((obj or {}).get("metadata") or {}).get("labels") or {})
        self.engines, self.keys, self.namespace_labels = engines, keys, labels


def file_secrets(keys: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A file's ``{"namespace", "key", "role"}`` entries as the Secrets they stand for (an
    entry that is not an object: one without a namespace, logged and skipped)."""
    out = []
    for i, k in enumerate(keys):
        k = k if isinstance(k, Mapping) else {}
        labels = {KEY_LABEL: "true", ROLE_LABEL: str(k.get("role", "sample"))}
        meta = {"namespace": k.get("namespace"), "name": f"key-{i}", "labels": labels}
        out.append({"metadata": meta, "stringData": {KEY_FIELD: k.get("key")}})
    return out


class FileDirectory(Directory):
    """The view from a JSON file, re-read when it changes::

    {"engines": [{"name", "pool", "url", "token", "allowedNamespaces"?, "baseModel"?}],
     "keys": [{"namespace", "key", "role"}], "namespaceLabels"?: {ns: {k: v}}}
    """

    def __init__(self, path: str, refresh_s: float = 1.0) -> None:
        super().__init__(refresh_s)
        self.path = path
        self._stamp: tuple[int, int] | None = None

    async def refresh(self) -> None:
        st = os.stat(self.path)
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        with open(self.path, encoding="utf-8") as f:
            doc = json.load(f)
        # Keys first, on their own: an edit's removals apply even if the rest is bad.
        keys, problems = KeyTable.from_secrets(file_secrets(doc.get("keys", [])))
        for p in problems:
            log.warning("API key not loaded: %s", p)
        self.keys = keys
        engines = [
            Engine(
                name=e["name"],
                pool=e.get("pool", "default"),
                url=e["url"].rstrip("/"),
                token=e["token"],
                allowed_namespaces=tuple(e["allowedNamespaces"])
                if e.get("allowedNamespaces") is not None
                else None,
                base_model=e.get("baseModel"),
            )
            for e in doc.get("engines", [])
        ]
        self.engines = engines
        self.namespace_labels = {k: dict(v) for k, v in doc.get("namespaceLabels", {}).items()}
        self._stamp = stamp
