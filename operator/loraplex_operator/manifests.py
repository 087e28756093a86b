"""Engine Pod manifests built from an EnginePool (pure, no I/O).

The operator owns engine Pods directly (no Deployment) so that it chooses which engine
to remove. Every pod is labelled with its pool, owned by the pool (controller owner
reference, so deleting the pool garbage-collects its engines), and carries a hash of
the pool spec parts it was built from, so drift is visible.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from typing import Any

GROUP = "loraplex.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

POOL_LABEL = "loraplex.dev/pool"
COMPONENT_LABEL = "app.kubernetes.io/component"
SPEC_HASH_ANNOTATION = "loraplex.dev/spec-hash"
# Where the engine listens, when not http://<podIP>:8000 (test kubelets, host networking).
ENGINE_URL_ANNOTATION = "loraplex.dev/engine-url"
ENGINE_PORT = 8000
TOKEN_DIR = "/var/run/loraplex"
TOKEN_FILE = f"{TOKEN_DIR}/token"
TOKEN_VOLUME = "loraplex-token"
CHECKPOINT_VOLUME = "loraplex-checkpoints"
CONTAINER = "engine"
DEFAULT_NAMESPACE = "loraplex-system"


def engine_labels(pool_name: str) -> dict[str, str]:
    """Labels on every engine pod of a pool (select a pool's engines with POOL_LABEL)."""
    return {
        POOL_LABEL: pool_name,
        "app.kubernetes.io/name": "loraplex-engine",
        COMPONENT_LABEL: "engine",
        "app.kubernetes.io/managed-by": "loraplex-operator",
    }


def engine_pod_name(pool_name: str, suffix: str) -> str:
    """`<pool>-engine-<suffix>`; the CRD caps pool names at 40 so this stays a DNS label."""
    return f"{pool_name}-engine-{suffix}"


def engine_namespace(pool: Mapping[str, Any]) -> str:
    return pool.get("spec", {}).get("engineNamespace", DEFAULT_NAMESPACE)


def owner_reference(pool: Mapping[str, Any]) -> dict[str, Any]:
    meta = pool["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": "EnginePool",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def spec_hash(pool: Mapping[str, Any]) -> str:
    """Short stable hash of the pool spec fields that shape an engine pod."""
    spec = pool.get("spec", {})
    keys = ("baseModel", "rolloutBackend", "capacity", "template", "checkpoint", "tokenSecretRef")
    shaped = {k: spec.get(k) for k in keys}
    # Only when set, so a pool without them keeps its hash (and its pods).
    shaped |= {k: spec[k] for k in TRUST_FIELDS if k in spec}
    blob = json.dumps(shaped, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def engine_args(spec: Mapping[str, Any]) -> list[str]:
    """`loraplex-engine serve ...` arguments for a pool spec."""
    capacity = spec.get("capacity", {})
    return [
        "serve",
        "--model", spec["baseModel"],
        "--port", str(ENGINE_PORT),
        "--token-file", TOKEN_FILE,
        "--checkpoint-root", _checkpoint_root(spec),
        "--max-adapters", str(capacity.get("maxAdapters", 8)),
        "--max-rank", str(capacity.get("maxRank", 64)),
        "--rollout-backend", spec.get("rolloutBackend", "torch"),
        *trust_args(spec),
        *spec.get("template", {}).get("extraArgs", []),
    ]  # fmt: skip


TRUST_FIELDS = ("dataRoots", "rewardHosts")


def trust_args(spec: Mapping[str, Any]) -> list[str]:
    """The pool's data roots and reward hosts as `serve` flags (`--flag=value`: a value
    is never read as another flag)."""
    return [f"--data-root={d}" for d in spec.get("dataRoots", [])] + [
        f"--allow-reward-host={h}" for h in spec.get("rewardHosts", [])
    ]


def _checkpoint_root(spec: Mapping[str, Any]) -> str:
    return spec.get("checkpoint", {}).get("root", "/ckpt")


def _env(pool_name: str, template: Mapping[str, Any]) -> list[dict[str, Any]]:
    ours = [
        {"name": "LORAPLEX_POOL", "value": pool_name},
        {"name": "LORAPLEX_ENGINE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    taken = {e["name"] for e in ours}
    return ours + [copy.deepcopy(e) for e in template.get("env", []) if e["name"] not in taken]


def _volumes(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    secret = spec["tokenSecretRef"]
    token = {
        "name": TOKEN_VOLUME,
        "secret": {
            "secretName": secret["name"],
            "items": [{"key": secret.get("key", "token"), "path": "token"}],
            "defaultMode": 0o400,
        },
    }
    source = spec.get("checkpoint", {}).get("volume") or {"emptyDir": {}}
    checkpoints = {"name": CHECKPOINT_VOLUME, **copy.deepcopy(source)}
    return [token, checkpoints, *copy.deepcopy(spec.get("template", {}).get("volumes", []))]


def _volume_mounts(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [
        {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True},
        {"name": CHECKPOINT_VOLUME, "mountPath": _checkpoint_root(spec)},
        *copy.deepcopy(spec.get("template", {}).get("volumeMounts", [])),
    ]


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def _container(pool_name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    template = spec["template"]
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": template["image"],
        "command": ["loraplex-engine"],
        "args": engine_args(spec),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "env": _env(pool_name, template),
        "volumeMounts": _volume_mounts(spec),
        "readinessProbe": _probe("/readyz", 5, 3),
        # Model loading can take minutes: the startup probe guards liveness until /healthz.
        "startupProbe": _probe("/healthz", 5, 120),
        "livenessProbe": _probe("/healthz", 10, 6),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if "imagePullPolicy" in template:
        container["imagePullPolicy"] = template["imagePullPolicy"]
    if template.get("resources"):
        container["resources"] = copy.deepcopy(template["resources"])
    return container


def engine_pod(pool: Mapping[str, Any], suffix: str) -> dict[str, Any]:
    """The engine Pod for `pool` (an EnginePool object with metadata.name and uid)."""
    pool_name = pool["metadata"]["name"]
    spec = pool["spec"]
    template = spec["template"]
    pod_spec: dict[str, Any] = {
        "containers": [_container(pool_name, spec)],
        "volumes": _volumes(spec),
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 60,  # time to checkpoint on shutdown
        "automountServiceAccountToken": False,  # the engine knows nothing of Kubernetes
        "enableServiceLinks": False,
    }
    for key in ("nodeSelector", "tolerations", "affinity", "imagePullSecrets"):
        if template.get(key):
            pod_spec[key] = copy.deepcopy(template[key])
    for key in ("serviceAccountName", "priorityClassName"):
        if template.get(key):
            pod_spec[key] = template[key]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": engine_pod_name(pool_name, suffix),
            "namespace": engine_namespace(pool),
            "labels": engine_labels(pool_name),
            "annotations": {SPEC_HASH_ANNOTATION: spec_hash(pool)},
            "ownerReferences": [owner_reference(pool)],
        },
        "spec": pod_spec,
    }


def engine_url(pod: Mapping[str, Any]) -> str | None:
    """The `loraplex.dev/engine-url` annotation if set, else http://<podIP>:8000 once the
    pod has an IP."""
    annotated = (pod.get("metadata", {}).get("annotations") or {}).get(ENGINE_URL_ANNOTATION)
    if annotated:
        return annotated.rstrip("/")
    ip = pod.get("status", {}).get("podIP")
    return f"http://{ip}:{ENGINE_PORT}" if ip else None


def is_pod_ready(pod: Mapping[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
