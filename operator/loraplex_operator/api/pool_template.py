"""``EnginePool.spec.template``: the engine pod's moving parts.

The pod-shaped parts are core/v1 objects that the API server validates when the Pod is
created, so the CRD types only what the operator or a CEL rule reads (a volume's name,
a mount's path) and keeps the rest as written (``OpenModel``); the operator copies them
into the engine pod unchanged.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from loraplex_operator.api.schema import PRESERVE_UNKNOWN, ApiModel, Cel, OpenModel, list_map

# Volumes the operator adds to every engine pod (manifests.py); a template may not reuse them.
TOKEN_VOLUME = "loraplex-token"
CHECKPOINT_VOLUME = "loraplex-checkpoints"
SHM_VOLUME = "loraplex-shm"
RESERVED_VOLUMES = (TOKEN_VOLUME, CHECKPOINT_VOLUME, SHM_VOLUME)

# An open core/v1 object (ResourceRequirements, Affinity, a Toleration, a VolumeSource).
CoreObject = Annotated[dict[str, Any], Field(json_schema_extra=PRESERVE_UNKNOWN)]


class LocalObjectReference(ApiModel):
    name: str = Field(description="Name of the Secret.")


class Volume(OpenModel):
    name: str = Field(min_length=1, max_length=63, description="Volume name (unique in the pod).")


class VolumeMount(OpenModel):
    name: str = Field(min_length=1, max_length=63, description="The template volume to mount.")
    mount_path: str = Field(
        alias="mountPath", min_length=1, max_length=4096, description="Where in the container."
    )


class EnvVar(OpenModel):
    name: str = Field(min_length=1, max_length=256, description="Variable name.")


_RESERVED_CEL = ", ".join(f"'{v}'" for v in RESERVED_VOLUMES)


class EngineTemplate(ApiModel):
    """The engine pod's moving parts; the operator fills in command, args, probes, token
    and checkpoint mounts. The pod-shaped fields are core/v1 and are validated by the API
    server when the Pod is created."""

    CEL_RULES: ClassVar = (
        Cel(
            f"!has(self.volumes) || !self.volumes.exists(v, v.name in [{_RESERVED_CEL}])",
            "template.volumes must not use the reserved names loraplex-token, "
            "loraplex-checkpoints and loraplex-shm",
        ),
        Cel(
            "!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && "
            "self.volumes.exists(v, v.name == m.name))",
            "every template.volumeMounts entry must name a volume in template.volumes",
        ),
    )

    image: str = Field(
        min_length=1,
        max_length=1024,
        description="Engine container image (holds loraplex-engine, and vLLM for "
        "rolloutBackend vllm).",
    )
    shm_size: str = Field(
        "1Gi",
        alias="shmSize",
        max_length=32,
        pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$",
        description="Size of the memory-backed /dev/shm (an emptyDir, medium Memory, volume "
        "loraplex-shm) mounted when gpusPerEngine is above 1 (NCCL's shared-memory transport "
        "between the ranks needs more than a container runtime's 64 MiB default; NVIDIA's "
        "containers are run with --shm-size=1g) and on a one-rank rolloutBackend vllm engine "
        "whose template mounts no /dev/shm of its own (adapter updates cross to vLLM through "
        "it). A quantity (1Gi, 512Mi); what is written there counts against the container's "
        "memory limit.",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        None,
        alias="imagePullPolicy",
        description="The container's imagePullPolicy; absent = Kubernetes' default.",
    )
    log_format: Literal["text", "json"] | None = Field(
        None,
        alias="logFormat",
        description="The engine's log format (`serve --log-format`): text, or json (one JSON "
        "object per line: time, level, logger, message, exception and the access log's "
        "fields) for a log pipeline that parses them. Absent = the operator's default "
        "(LORAPLEX_ENGINE_LOG_FORMAT: the chart's engines.logFormat, else its "
        "operator.logFormat).",
    )
    image_pull_secrets: tuple[LocalObjectReference, ...] | None = Field(
        None,
        alias="imagePullSecrets",
        max_length=16,
        description="Secrets (in engineNamespace) for pulling the image.",
    )
    service_account_name: str | None = Field(
        None,
        alias="serviceAccountName",
        max_length=253,
        description="The engine pod's service account (its token is not mounted: the engine "
        "never calls the API server).",
    )
    priority_class_name: str | None = Field(
        None,
        alias="priorityClassName",
        max_length=253,
        description="The engine pod's PriorityClass.",
    )
    resources: CoreObject | None = Field(
        None,
        description="core/v1 ResourceRequirements of the engine container. Asking for "
        "nvidia.com/gpu makes a GPU pool: the operator raises that count to at least "
        "gpusPerEngine (limits, and requests where set); without it the engines run on the "
        "CPU.",
    )
    node_selector: dict[str, str] | None = Field(
        None,
        alias="nodeSelector",
        description="The engine pod's nodeSelector (e.g. a GPU node label).",
    )
    tolerations: tuple[CoreObject, ...] | None = Field(
        None, max_length=64, description="The engine pod's core/v1 tolerations."
    )
    affinity: CoreObject | None = Field(None, description="The engine pod's core/v1 Affinity.")
    volumes: tuple[Volume, ...] | None = Field(
        None,
        max_length=64,
        description="Extra core/v1 volumes of the engine pod (e.g. a PVC holding the base "
        "model); loraplex-token, loraplex-checkpoints and loraplex-shm are reserved.",
        json_schema_extra=list_map("name"),
    )
    volume_mounts: tuple[VolumeMount, ...] | None = Field(
        None,
        alias="volumeMounts",
        max_length=64,
        description="Extra core/v1 volumeMounts of the engine container, each of a template "
        "volume.",
    )
    env: tuple[EnvVar, ...] | None = Field(
        None,
        max_length=256,
        description="Extra core/v1 environment variables of the engine container; "
        "LORAPLEX_POOL and LORAPLEX_ENGINE are set by the operator and win.",
        json_schema_extra=list_map("name"),
    )
    extra_args: tuple[Annotated[str, Field(max_length=1024)], ...] | None = Field(
        None,
        alias="extraArgs",
        max_length=64,
        description="Extra flags appended to `loraplex-engine serve` (see `loraplex-engine "
        "serve --help`).",
    )


__all__ = [
    "CHECKPOINT_VOLUME",
    "RESERVED_VOLUMES",
    "SHM_VOLUME",
    "TOKEN_VOLUME",
    "EngineTemplate",
    "EnvVar",
    "LocalObjectReference",
    "Volume",
    "VolumeMount",
]
