"""AIBrix `ModelAdapter` objects for published aliases (docs/versions.md, "AIBrix"): on
clusters that serve LoRA adapters through AIBrix (chart value `aibrix.enabled`), one
`model.aibrix.ai/v1alpha1` ModelAdapter per alias of each experiment that publishes,
named `<experiment>-<alias>` in the experiment's namespace, its `artifactURL` the
directory of the version the alias points at, owned by the LoRAExperiment (deleting the
experiment deletes them). A move of the alias patches the artifact; an alias removed
deletes its ModelAdapter.

The fields are AIBrix's ModelAdapterSpec (api/model/v1alpha1/modeladapter_types.go in
vllm-project/aibrix): `podSelector` (required), `artifactURL` (required; AIBrix accepts
s3://, gcs://, huggingface://, hf:// and absolute paths: here the path the serving pods
mount the checkpoint volume at), `baseModel` (optional). AIBrix registers the adapter in
vLLM under the ModelAdapter's name.

Pure but for `AdapterSync`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from loraplex_operator.kube import Kube, KubeError, Resource
from loraplex_operator.resources import API_VERSION, Experiment

log = logging.getLogger("loraplex_operator.aibrix")

MODEL_ADAPTERS = Resource("model.aibrix.ai", "v1alpha1", "modeladapters")
LABEL_EXPERIMENT = "loraplex.dev/experiment"
LABEL_ALIAS = "loraplex.dev/alias"
MANAGED_BY = {"app.kubernetes.io/managed-by": "loraplex"}
# AIBrix may name a Service after the adapter: keep names DNS labels (63 characters).
MAX_NAME = 63


@dataclass(frozen=True)
class AibrixConfig:
    """`artifact_root`: where the serving pods mount the checkpoint volume (versions are
    `<root>/<ns>/<name>/_versions/v<N>` there); `pod_selector`: matchLabels of the vLLM
    pods AIBrix loads the adapters into; `base_model`: their base model's name, if set."""

    artifact_root: str = "/ckpt"
    pod_selector: Mapping[str, str] = field(default_factory=dict)
    base_model: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> AibrixConfig | None:
        """None unless LORAPLEX_AIBRIX is on (the chart's `aibrix.enabled`)."""
        if env.get("LORAPLEX_AIBRIX", "").strip().lower() not in ("1", "true"):
            return None
        selector = json.loads(env.get("LORAPLEX_AIBRIX_POD_SELECTOR") or "{}")
        if not isinstance(selector, dict) or not selector:
            raise ValueError("LORAPLEX_AIBRIX_POD_SELECTOR must be a non-empty JSON object")
        return cls(
            artifact_root=env.get("LORAPLEX_AIBRIX_ARTIFACT_ROOT", cls.artifact_root).rstrip("/"),
            pod_selector={str(k): str(v) for k, v in selector.items()},
            base_model=env.get("LORAPLEX_AIBRIX_BASE_MODEL", "").strip(),
        )


def artifact_url(root: str, namespace: str, name: str, version: str) -> str:
    """The version's directory as the serving pods see it (the engine's VersionStore
    layout: a test holds the two together)."""
    return f"{root.rstrip('/')}/{namespace}/{name}/_versions/{version}"


def adapter_name(experiment: str, alias: str) -> str:
    """`<experiment>-<alias>`; a longer one keeps its start and a hash of the whole."""
    name = f"{experiment}-{alias}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    return f"{name[: MAX_NAME - 11].rstrip('-.')}-{digest}"


def desired(
    exp: Experiment, aliases: Mapping[str, str], cfg: AibrixConfig
) -> dict[str, dict[str, Any]]:
    """Adapter name -> the ModelAdapter to exist for each alias of `exp`."""
    meta = exp.meta
    out: dict[str, dict[str, Any]] = {}
    for alias, version in sorted(aliases.items()):
        spec: dict[str, Any] = {
            "podSelector": {"matchLabels": dict(cfg.pod_selector)},
            "artifactURL": artifact_url(cfg.artifact_root, meta.namespace, meta.name, version),
        }
        if cfg.base_model:
            spec["baseModel"] = cfg.base_model
        name = adapter_name(meta.name, alias)
        out[name] = {
            "apiVersion": f"{MODEL_ADAPTERS.group}/{MODEL_ADAPTERS.version}",
            "kind": "ModelAdapter",
            "metadata": {
                "name": name,
                "namespace": meta.namespace,
                "labels": {LABEL_EXPERIMENT: meta.name, LABEL_ALIAS: alias, **MANAGED_BY},
                "ownerReferences": [owner_reference(exp)],
            },
            "spec": spec,
        }
    return out


def owner_reference(exp: Experiment) -> dict[str, Any]:
    """The LoRAExperiment as controller owner: the garbage collector deletes the
    ModelAdapters with it. No blockOwnerDeletion (that would need the finalizers RBAC)."""
    return {
        "apiVersion": API_VERSION,
        "kind": "LoRAExperiment",
        "name": exp.meta.name,
        "uid": exp.meta.uid,
        "controller": True,
    }


def specs(objs: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Name -> spec of ModelAdapters (as listed, or as `desired` makes them)."""
    return {o["metadata"]["name"]: dict(o.get("spec") or {}) for o in objs}


# ---- I/O ------------------------------------------------------------------------------


class AdapterSync:
    """Keeps each experiment's ModelAdapters equal to `desired`; remembers what it wrote
    so an unchanged round makes no call (a restarted operator lists once per experiment)."""

    def __init__(self, kube: Kube, cfg: AibrixConfig) -> None:
        self.kube = kube
        self.cfg = cfg
        self.applied: dict[str, dict[str, dict[str, Any]]] = {}  # experiment key -> specs

    async def sync(self, key: str, exp: Experiment, aliases: Mapping[str, str] | None) -> None:
        """`aliases` as the engine reported them this round (None: no report, no change)."""
        if aliases is None or not exp.meta.uid:
            return
        want = desired(exp, aliases, self.cfg)
        ns = exp.meta.namespace
        try:
            have = self.applied.get(key)
            if have is None:
                listed = await self.kube.list(MODEL_ADAPTERS, ns, {LABEL_EXPERIMENT: exp.meta.name})
                have = specs(listed)
            if have == specs(want.values()):
                self.applied[key] = have
                return
            for name, obj in want.items():
                if name not in have:
                    await self._create(obj, ns)
                elif have[name] != obj["spec"]:
                    await self.kube.patch(MODEL_ADAPTERS, name, {"spec": obj["spec"]}, ns)
            for name in sorted(have.keys() - want.keys()):
                await self.kube.delete(MODEL_ADAPTERS, name, ns)
        except KubeError as e:  # next round lists again and retries
            self.applied.pop(key, None)
            log.warning("ModelAdapters of %s: %s", key, e)
            return
        self.applied[key] = specs(want.values())
        log.info("ModelAdapters of %s: %s", key, sorted(want))

    async def _create(self, obj: dict[str, Any], ns: str) -> None:
        try:
            await self.kube.create(MODEL_ADAPTERS, obj, ns)
        except KubeError as e:
            if e.status != 409:
                raise
            name = obj["metadata"]["name"]  # there already (not labelled as ours): adopt it
            patch = {k: obj[k] for k in ("spec",)} | {"metadata": obj["metadata"]}
            await self.kube.patch(MODEL_ADAPTERS, name, patch, ns)

    def forget_others(self, keys: Iterable[str]) -> None:
        keep = set(keys)
        for key in self.applied.keys() - keep:
            del self.applied[key]
