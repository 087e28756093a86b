"""Engine Pod manifests built from an EnginePool (pure, no I/O).

The operator owns engine Pods directly (no Deployment) so that it chooses which engine
to remove. Every pod is labelled with its pool, owned by the pool (controller owner
reference, so deleting the pool garbage-collects its engines). Scalar settings are read
through the pool's typed view (its CRD defaults in one place); the pod template's parts
(env, volumes, resources, scheduling) are copied from the raw spec as written, except
what `gpusPerEngine` adds to a multi-rank engine: one GPU per rank on a GPU pool,
`--world-size` (and `--shard-base` with `shardBase`) and a memory-backed /dev/shm, which
a one-rank vLLM engine gets too (`mounts_shm`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from loraplex_operator.resources import API_VERSION, GROUP, POOL_KIND, PoolSpec

POOL_LABEL = f"{GROUP}/pool"
COMPONENT_LABEL = "app.kubernetes.io/component"
# Where the engine listens, when not http://<podIP>:8000 (test kubelets, host networking).
ENGINE_URL_ANNOTATION = f"{GROUP}/engine-url"
ENGINE_PORT = 8000
TOKEN_DIR = "/var/run/loraplex"
TOKEN_FILE = f"{TOKEN_DIR}/token"
TOKEN_VOLUME = "loraplex-token"
CHECKPOINT_VOLUME = "loraplex-checkpoints"
CONTAINER = "engine"
# The engine's memory-backed /dev/shm, sized by template.shmSize (see `mounts_shm`).
SHM_VOLUME = "loraplex-shm"
SHM_PATH = "/dev/shm"
# The device plugin's resource: asking for it is what makes a pool a GPU pool.
GPU_RESOURCE = "nvidia.com/gpu"
# Kueue's pod integration admits a Pod carrying this label through the named LocalQueue
# (its webhook adds a scheduling gate, lifted once the quota admits the Pod).
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def engine_labels(pool_name: str, queue_name: str | None = None) -> dict[str, str]:
    """Labels on every engine pod of a pool (select a pool's engines with POOL_LABEL),
    and the Kueue queue label when the pool names a queue."""
    labels = {
        POOL_LABEL: pool_name,
        "app.kubernetes.io/name": "loraplex-engine",
        COMPONENT_LABEL: "engine",
        "app.kubernetes.io/managed-by": "loraplex-operator",
    }
    if queue_name:
        labels[KUEUE_QUEUE_LABEL] = queue_name
    return labels


def engine_pod_name(pool_name: str, suffix: str) -> str:
    """`<pool>-engine-<suffix>`; the CRD caps pool names at 40 so this stays a DNS label."""
    return f"{pool_name}-engine-{suffix}"


def engine_namespace(pool: Mapping[str, Any]) -> str:
    return PoolSpec.from_obj(pool.get("spec") or {}).engine_namespace


def owner_reference(pool: Mapping[str, Any]) -> dict[str, Any]:
    meta = pool["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": POOL_KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def engine_args(spec: Mapping[str, Any]) -> list[str]:
    """`loraplex-engine serve ...` arguments for a pool spec."""
    view = PoolSpec.from_obj(spec)
    return [
        "serve",
        "--model", spec["baseModel"],
        "--port", str(ENGINE_PORT),
        "--token-file", TOKEN_FILE,
        "--checkpoint-root", view.checkpoint_root,
        "--max-adapters", str(view.capacity.max_adapters),
        "--max-rank", str(view.capacity.max_rank),
        "--rollout-backend", view.rollout_backend,
        *_precision_args(view),
        *_vllm_args(view),
        *_memory_args(view),
        *_world_args(view),
        *trust_args(view),
        *spec.get("template", {}).get("extraArgs", []),
    ]  # fmt: skip


def _precision_args(view: PoolSpec) -> list[str]:
    """Only what the pool sets: otherwise the engine picks by its device."""
    args = [] if view.dtype is None else ["--dtype", view.dtype]
    if view.gradient_checkpointing is not None:
        on = view.gradient_checkpointing
        args.append("--gradient-checkpointing" if on else "--no-gradient-checkpointing")
    return args


def _vllm_args(view: PoolSpec) -> list[str]:
    """spec.vllm as `--vllm-option` settings (JSON values), for vLLM pools only."""
    if view.rollout_backend != "vllm":
        return []
    placement = view.vllm
    settings = {
        "device": placement.device,
        "gpu_memory_utilization": placement.gpu_memory_utilization,
        "sleep_mode": placement.sleep_mode,
    }
    return [
        f"--vllm-option={key}={json.dumps(value)}"
        for key, value in settings.items()
        if value is not None
    ]


def _memory_args(view: PoolSpec) -> list[str]:
    """Only what the pool sets: otherwise the engine's memory plan derives them."""
    capacity, args = view.capacity, []
    if capacity.micro_batch_tokens is not None:
        args += ["--micro-batch-tokens", str(capacity.micro_batch_tokens)]
    if capacity.rollout_kv_tokens is not None:
        args += ["--rollout-kv-tokens", str(capacity.rollout_kv_tokens)]
    if capacity.device_memory_bytes is not None:
        args += ["--device-memory", str(capacity.device_memory_bytes)]
    return args


def _world_args(view: PoolSpec) -> list[str]:
    """`--world-size N` for a multi-rank engine only, and `--shard-base` where the pool
    shards its base: a one-rank engine's command line stays what it was (and runs on
    images without the flags). shardBase with one rank, which the CRD refuses, is passed
    as written, so that `serve` names the mistake rather than the engine running the base
    whole on one GPU it may not fit."""
    n = view.gpus_per_engine
    world = ["--world-size", str(n)] if n > 1 else []
    return world + (["--shard-base"] if view.shard_base else [])


def trust_args(view: PoolSpec) -> list[str]:
    """The pool's data roots and reward hosts as `serve` flags (`--flag=value`: a value
    is never read as another flag)."""
    return [f"--data-root={d}" for d in view.data_roots] + [
        f"--allow-reward-host={h}" for h in view.reward_hosts
    ]


def _env(pool_name: str, template: Mapping[str, Any]) -> list[dict[str, Any]]:
    ours = [
        {"name": "LORAPLEX_POOL", "value": pool_name},
        {"name": "LORAPLEX_ENGINE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    taken = {e["name"] for e in ours}
    return ours + [copy.deepcopy(e) for e in template.get("env", []) if e["name"] not in taken]


def _volumes(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    secret = PoolSpec.from_obj(spec).token_secret
    token = {
        "name": TOKEN_VOLUME,
        "secret": {
            "secretName": spec["tokenSecretRef"]["name"],  # required: a KeyError names it
            "items": [{"key": secret.key, "path": "token"}],
            "defaultMode": 0o400,
        },
    }
    source = spec.get("checkpoint", {}).get("volume") or {"emptyDir": {}}
    checkpoints = {"name": CHECKPOINT_VOLUME, **copy.deepcopy(source)}
    view = PoolSpec.from_obj(spec)
    shm = [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": view.shm_size}}]
    extra = copy.deepcopy(spec.get("template", {}).get("volumes", []))
    return [token, checkpoints, *(shm if mounts_shm(spec) else []), *extra]


def mounts_shm(spec: Mapping[str, Any]) -> bool:
    """Whether the operator mounts its memory-backed /dev/shm in the engine pods.

    Always on a multi-rank engine: NCCL's shared-memory transport needs more than the
    runtime's 64 MiB (the CRD refuses a template mounting /dev/shm there). On a one-rank
    vLLM engine unless the template mounts its own: each adapter update crosses to the
    vLLM worker through a /dev/shm segment, and a rank-32 adapter of a 4B model (~130 MB
    in bf16) would not fit 64 MiB and fall back to the slower pipe.
    """
    view = PoolSpec.from_obj(spec)
    if view.gpus_per_engine > 1:
        return True
    mounts = spec.get("template", {}).get("volumeMounts", [])
    own = any(m.get("mountPath", "").rstrip("/") == SHM_PATH for m in mounts)
    return view.rollout_backend == "vllm" and not own


def _volume_mounts(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    view = PoolSpec.from_obj(spec)
    shm = [{"name": SHM_VOLUME, "mountPath": SHM_PATH}] if mounts_shm(spec) else []
    return [
        {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True},
        {"name": CHECKPOINT_VOLUME, "mountPath": view.checkpoint_root},
        *shm,
        *copy.deepcopy(spec.get("template", {}).get("volumeMounts", [])),
    ]


def engine_resources(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The template's resources, with one GPU per rank on a GPU pool.

    A pool asking for nvidia.com/gpu (limits or requests) is a GPU pool: its count is
    raised to at least gpusPerEngine, in limits and in requests where the template sets
    it (the two must be equal for an extended resource). Never lowered: a template may
    ask for more (vllm.device on a GPU of its own). A CPU pool asks for no GPU: its
    gloo ranks share the container's CPUs, as the template sizes them.
    """
    resources = copy.deepcopy(dict(spec.get("template", {}).get("resources") or {}))
    asked = {
        part: _whole(resources[part][GPU_RESOURCE])
        for part in ("limits", "requests")
        if GPU_RESOURCE in (resources.get(part) or {})
    }
    if not any(asked.values()):
        return resources
    count = max(PoolSpec.from_obj(spec).gpus_per_engine, *asked.values())
    for part in {"limits", *asked}:
        resources.setdefault(part, {})[GPU_RESOURCE] = count
    return resources


def _whole(quantity: Any) -> int:
    """A GPU count as written (1 or "1"); 0 for what is not a whole number, which the
    count above then replaces (the API server accepts only whole GPUs anyway)."""
    try:
        return max(int(str(quantity)), 0)
    except ValueError:
        return 0


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
    resources = engine_resources(spec)
    if resources:
        container["resources"] = resources
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
            "labels": engine_labels(pool_name, PoolSpec.from_obj(spec).queue_name),
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
