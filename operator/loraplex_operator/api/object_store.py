"""``EnginePool.spec.objectStore``: the object storage tenants' datasets may be read from
(``task.dataset: s3://...``), each namespace only below its own prefix, with credentials
from a Secret the pool admin names (never from a tenant's spec).

The operator passes it to every engine pod (manifests.py): the prefixes, endpoint and
region as ``serve`` settings, the Secret's keys as ``LORAPLEX_S3_*`` variables the engine
reads once at start and removes from its environment. docs/datasets.md is the guide.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from loraplex_operator.api.schema import LIST_SET, ApiModel

SecretKey = Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")]
# s3:// or gs://, a bucket, then path segments of which one is exactly {namespace}, and '/'.
_SEGMENT = r"[A-Za-z0-9_=+,@~-][A-Za-z0-9._=+,@~-]*/"  # not "." or ".."
PREFIX_PATTERN = (
    rf"^(s3|gs)://[a-z0-9][a-z0-9._-]{{1,61}}[a-z0-9]/({_SEGMENT})*\{{namespace\}}/({_SEGMENT})*$"
)
Prefix = Annotated[str, Field(min_length=8, max_length=512, pattern=PREFIX_PATTERN)]


class ObjectStoreSecret(ApiModel):
    """A Secret in the pool's engineNamespace, and which of its keys holds what."""

    name: str = Field(min_length=1, max_length=253, description="Name of the Secret.")
    access_key_id_key: SecretKey = Field(
        "AWS_ACCESS_KEY_ID", alias="accessKeyIdKey", description="Key of the access key id."
    )
    secret_access_key_key: SecretKey = Field(
        "AWS_SECRET_ACCESS_KEY",
        alias="secretAccessKeyKey",
        description="Key of the secret access key.",
    )
    session_token_key: SecretKey = Field(
        "AWS_SESSION_TOKEN",
        alias="sessionTokenKey",
        description="Key of a session token; used where the Secret has it.",
    )


class ObjectStore(ApiModel):
    """Where s3:// (and, with gcsfs in the engine image, gs://) datasets are read."""

    prefixes: Annotated[tuple[Prefix, ...], Field(min_length=1, max_length=16)] = Field(
        description="URL templates a namespace's datasets must lie under, each holding "
        "{namespace} as one whole path segment and ending with '/': s3://datasets/{namespace}/ "
        "lets namespace team-a read s3://datasets/team-a/... and nothing else. The engine "
        "refuses (422) a URL elsewhere, or one not already in its plain form (no %-escapes, "
        "'.', '..' or empty segments, query or port).",
        json_schema_extra=LIST_SET,
    )
    secret_ref: ObjectStoreSecret | None = Field(
        None,
        alias="secretRef",
        description="The credentials, a Secret in engineNamespace, passed to the engines as "
        "LORAPLEX_S3_ACCESS_KEY_ID, LORAPLEX_S3_SECRET_ACCESS_KEY and LORAPLEX_S3_SESSION_TOKEN. "
        "Absent = botocore's own chain (a workload identity on the engine's service account).",
    )
    endpoint_url: str | None = Field(
        None,
        alias="endpointUrl",
        max_length=512,
        pattern=r"^https?://[^\s/]+/?$",
        description="S3 API endpoint (MinIO, Ceph, another cloud's S3). Absent = AWS's.",
    )
    region: str | None = Field(
        None, min_length=1, max_length=64, pattern=r"^[a-z0-9-]+$", description="The region."
    )
