"""Engine Pod manifests built from an EnginePool (pure, no I/O).

The operator owns engine Pods directly (no Deployment) so that it chooses which engine
to remove. Every pod is labelled with its pool, owned by the pool (controller owner
reference, so deleting the pool garbage-collects its engines). Everything is read from
the pool's typed spec (`api.pool.EnginePoolSpec`, parsed once by `Pool.from_obj`, its
CRD defaults in one place); the pod template's core/v1 parts (env, volumes, resources,
scheduling) are copied as written, except what `gpusPerEngine` adds to a multi-rank
engine: one GPU per rank on a GPU pool, `--world-size` (and `--shard-base` with
`shardBase`) and a memory-backed /dev/shm, which a one-rank vLLM engine gets too
(`mounts_shm`).
"""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Mapping
from typing import Any

from loraplex_operator.api.object_store import ObjectStore
from loraplex_operator.api.pool import EnginePoolSpec
from loraplex_operator.api.pool_template import CHECKPOINT_VOLUME, SHM_VOLUME, TOKEN_VOLUME
from loraplex_operator.api.pool_tracking import tracking_args
from loraplex_operator.resources import API_VERSION, GROUP, POOL_KIND, Pool

POOL_LABEL = f"{GROUP}/pool"
COMPONENT_LABEL = "app.kubernetes.io/component"
# Where the engine listens, when not http://<podIP>:8000 (test kubelets, host networking).
ENGINE_URL_ANNOTATION = f"{GROUP}/engine-url"
ENGINE_PORT = 8000
TOKEN_DIR = "/var/run/loraplex"
TOKEN_FILE = f"{TOKEN_DIR}/token"
CONTAINER = "engine"
# The engine's memory-backed /dev/shm (SHM_VOLUME), sized by template.shmSize (see
# `mounts_shm`); the volume names are reserved in the API (api/pool_template.py).
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


def owner_reference(pool: Pool) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": POOL_KIND,
        "name": pool.meta.name,
        "uid": pool.meta.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def engine_args(spec: EnginePoolSpec, log_format: str = "text") -> list[str]:
    """`loraplex-engine serve ...` arguments for a pool spec; `log_format` is the
    operator's default where the template names no logFormat."""
    return [
        "serve",
        "--model", spec.base_model,
        "--port", str(ENGINE_PORT),
        "--token-file", TOKEN_FILE,
        "--checkpoint-root", spec.checkpoint.root,
        "--max-adapters", str(spec.capacity.max_adapters),
        "--max-rank", str(spec.capacity.max_rank),
        "--rollout-backend", spec.rollout_backend,
        *(f"--served-model-name={name}" for name in spec.served_model_names or ()),
        *_precision_args(spec),
        *_vllm_args(spec),
        *_memory_args(spec),
        *_world_args(spec),
        *_log_args(spec, log_format),
        *trust_args(spec),
        *tracking_args(spec.tracking),
        *(spec.template.extra_args or ()),
    ]  # fmt: skip


def _log_args(spec: EnginePoolSpec, default: str) -> list[str]:
    """`--log-format` where the template names one or the operator's default is not the
    engine's own (text): a pool that asks for neither keeps the command line it had
    before the setting existed, so it runs on images without the flag."""
    chosen = spec.template.log_format
    fmt = chosen or default
    return ["--log-format", fmt] if chosen or fmt != "text" else []


def _precision_args(spec: EnginePoolSpec) -> list[str]:
    """Only what the pool sets: otherwise the engine picks by its device."""
    args = [] if spec.dtype is None else ["--dtype", spec.dtype]
    if spec.gradient_checkpointing is not None:
        on = spec.gradient_checkpointing
        args.append("--gradient-checkpointing" if on else "--no-gradient-checkpointing")
    return args


def _vllm_args(spec: EnginePoolSpec) -> list[str]:
    """spec.vllm as `--vllm-option` settings (JSON values), for vLLM pools only."""
    if spec.rollout_backend != "vllm":
        return []
    placement = spec.vllm
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


def _memory_args(spec: EnginePoolSpec) -> list[str]:
    """Only what the pool sets: otherwise the engine's memory plan derives them."""
    capacity, args = spec.capacity, []
    if capacity.micro_batch_tokens is not None:
        args += ["--micro-batch-tokens", str(capacity.micro_batch_tokens)]
    if capacity.rollout_kv_tokens is not None:
        args += ["--rollout-kv-tokens", str(capacity.rollout_kv_tokens)]
    if capacity.device_memory_bytes is not None:
        args += ["--device-memory", str(capacity.device_memory_bytes)]
    # The engine's own default pages (64 x slots); a pool pages only when it sets this.
    registered = capacity.max_registered or capacity.max_adapters
    args += ["--max-registered", str(registered)]
    if capacity.host_adapter_memory_bytes is not None:
        args += ["--host-adapter-memory", str(capacity.host_adapter_memory_bytes)]
    return args


def _world_args(spec: EnginePoolSpec) -> list[str]:
    """`--world-size N` for a multi-rank engine only, and `--shard-base` where the pool
    shards its base: a one-rank engine's command line stays what it was (and runs on
    images without the flags). shardBase with one rank, which the CRD refuses, is passed
    as written, so that `serve` names the mistake rather than the engine running the base
    whole on one GPU it may not fit."""
    n = spec.gpus_per_engine
    world = ["--world-size", str(n)] if n > 1 else []
    return world + (["--shard-base"] if spec.shard_base else [])


def trust_args(spec: EnginePoolSpec) -> list[str]:
    """The pool's data roots, reward hosts, plug-in allowlist and checkpoint quota and
    retention as `serve` flags (`--flag=value`: a value is never read as another flag)."""
    quota, runs = spec.checkpoint.quota_bytes_per_namespace, spec.checkpoint.keep_runs
    return (
        [f"--data-root={d}" for d in spec.data_roots or ()]
        + (["--allow-dataset-hard-links"] if spec.allow_dataset_hard_links else [])
        + [f"--allow-reward-host={h}" for h in spec.reward_hosts or ()]
        + (spec.plugins.serve_flags() if spec.plugins else [])
        + ([f"--checkpoint-quota-bytes={quota}"] if quota is not None else [])
        + ([f"--checkpoint-keep-runs={runs}"] if runs is not None else [])
        + object_store_args(spec.object_store)
    )


def object_store_args(store: ObjectStore | None) -> list[str]:
    """The pool's object store as `serve` flags."""
    if store is None:
        return []
    return (
        [f"--object-store-prefix={p}" for p in store.prefixes]
        + ([f"--object-store-endpoint={store.endpoint_url}"] if store.endpoint_url else [])
        + ([f"--object-store-region={store.region}"] if store.region else [])
    )


def object_store_env(store: ObjectStore | None) -> list[dict[str, Any]]:
    """The Secret's keys as the engine's credential variables (the token optional)."""
    if store is None or store.secret_ref is None:
        return []
    ref = store.secret_ref

    def var(name: str, key: str, optional: bool = False) -> dict[str, Any]:
        selector: dict[str, Any] = {"name": ref.name, "key": key}
        if optional:
            selector["optional"] = True
        return {"name": name, "valueFrom": {"secretKeyRef": selector}}

    return [
        var("LORAPLEX_S3_ACCESS_KEY_ID", ref.access_key_id_key),
        var("LORAPLEX_S3_SECRET_ACCESS_KEY", ref.secret_access_key_key),
        var("LORAPLEX_S3_SESSION_TOKEN", ref.session_token_key, optional=True),
    ]


def _env(pool_name: str, spec: EnginePoolSpec) -> list[dict[str, Any]]:
    ours = [
        {"name": "LORAPLEX_POOL", "value": pool_name},
        {"name": "LORAPLEX_ENGINE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        *object_store_env(spec.object_store),
    ]
    taken = {e["name"] for e in ours}
    theirs = [e.to_json() for e in spec.template.env or () if e.name not in taken]
    return ours + theirs


def _volumes(spec: EnginePoolSpec) -> list[dict[str, Any]]:
    secret = spec.token_secret_ref
    token = {
        "name": TOKEN_VOLUME,
        "secret": {
            "secretName": secret.name,
            "items": [{"key": secret.key, "path": "token"}],
            "defaultMode": 0o400,
        },
    }
    source = spec.checkpoint.volume or {"emptyDir": {}}
    checkpoints = {"name": CHECKPOINT_VOLUME, **copy.deepcopy(source)}
    size = spec.template.shm_size
    shm = [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": size}}]
    extra = [v.to_json() for v in spec.template.volumes or ()]
    return [token, checkpoints, *(shm if mounts_shm(spec) else []), *extra]


def mounts_shm(spec: EnginePoolSpec) -> bool:
    """Whether the operator mounts its memory-backed /dev/shm in the engine pods.

    Always on a multi-rank engine: NCCL's shared-memory transport needs more than the
    runtime's 64 MiB (the CRD refuses a template mounting /dev/shm there). On a one-rank
    vLLM engine unless the template mounts its own: each adapter update crosses to the
    vLLM worker through a /dev/shm segment, and a rank-32 adapter of a 4B model (~130 MB
    in bf16) would not fit 64 MiB and fall back to the slower pipe.
    """
    if spec.gpus_per_engine > 1:
        return True
    mounts = spec.template.volume_mounts or ()
    own = any(m.mount_path.rstrip("/") == SHM_PATH for m in mounts)
    return spec.rollout_backend == "vllm" and not own


def _volume_mounts(spec: EnginePoolSpec) -> list[dict[str, Any]]:
    shm = [{"name": SHM_VOLUME, "mountPath": SHM_PATH}] if mounts_shm(spec) else []
    return [
        {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True},
        {"name": CHECKPOINT_VOLUME, "mountPath": spec.checkpoint.root},
        *shm,
        *(m.to_json() for m in spec.template.volume_mounts or ()),
    ]


def engine_resources(spec: EnginePoolSpec) -> dict[str, Any]:
    """The template's resources, with one GPU per rank on a GPU pool.

    A pool asking for nvidia.com/gpu (limits or requests) is a GPU pool: its count is
    raised to at least gpusPerEngine, in limits and in requests where the template sets
    it (the two must be equal for an extended resource). Never lowered: a template may
    ask for more (vllm.device on a GPU of its own). A CPU pool asks for no GPU: its
    gloo ranks share the container's CPUs, as the template sizes them.
    """
    resources = copy.deepcopy(dict(spec.template.resources or {}))
    asked = {
        part: _whole(resources[part][GPU_RESOURCE])
        for part in ("limits", "requests")
        if GPU_RESOURCE in (resources.get(part) or {})
    }
    if not any(asked.values()):
        return resources
    count = max(spec.gpus_per_engine, *asked.values())
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


def _container(pool_name: str, spec: EnginePoolSpec, log_format: str) -> dict[str, Any]:
    template = spec.template
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": template.image,
        "command": ["loraplex-engine"],
        "args": engine_args(spec, log_format),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "env": _env(pool_name, spec),
        "volumeMounts": _volume_mounts(spec),
        "readinessProbe": _probe("/readyz", 5, 3),
        # Model loading can take minutes: the startup probe guards liveness until /healthz.
        "startupProbe": _probe("/healthz", 5, 120),
        "livenessProbe": _probe("/healthz", 10, 6),
        # An engine that exits before it logs a termination message (a bad model path)
        # leaves its log's tail there: the pool's Stalled condition quotes it.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if template.image_pull_policy is not None:
        container["imagePullPolicy"] = template.image_pull_policy
    resources = engine_resources(spec)
    if resources:
        container["resources"] = resources
    return container


def _scheduling(spec: EnginePoolSpec) -> dict[str, Any]:
    """The template's pod-level settings, those it sets (an empty one is left out)."""
    t = spec.template
    parts: dict[str, Any] = {
        "nodeSelector": dict(t.node_selector or {}),
        "tolerations": [copy.deepcopy(x) for x in t.tolerations or ()],
        "affinity": copy.deepcopy(t.affinity),
        "imagePullSecrets": [s.to_json() for s in t.image_pull_secrets or ()],
        "serviceAccountName": t.service_account_name,
        "priorityClassName": t.priority_class_name,
    }
    return {key: value for key, value in parts.items() if value}


def engine_pod(pool: Pool, suffix: str, log_format: str = "text") -> dict[str, Any]:
    """The engine Pod for `pool` (an EnginePool with metadata.name and uid); `log_format`:
    the operator's engine log format (Config.engine_log_format), the template's wins."""
    spec = pool.spec
    pod_spec: dict[str, Any] = {
        "containers": [_container(pool.name, spec, log_format)],
        "volumes": _volumes(spec),
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 60,  # time to checkpoint on shutdown
        "automountServiceAccountToken": False,  # the engine knows nothing of Kubernetes
        "enableServiceLinks": False,
        **_scheduling(spec),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": engine_pod_name(pool.name, suffix),
            "namespace": spec.engine_namespace,
            "labels": engine_labels(pool.name, spec.queue_name),
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


TOKEN_COMPONENT = "engine-token"


def token_secret(namespace: str, name: str, key: str, token: str) -> dict[str, Any]:
    """The engine token Secret the operator creates when it is absent (the chart renders
    none, so that `helm template` is stable for GitOps). Not owned by any pool: pools
    share it and running engines mount it, so it outlives each of them."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                "app.kubernetes.io/name": "loraplex",
                "app.kubernetes.io/component": TOKEN_COMPONENT,
                "app.kubernetes.io/managed-by": "loraplex-operator",
            },
        },
        "type": "Opaque",
        "data": {key: base64.b64encode(token.encode()).decode()},
    }
