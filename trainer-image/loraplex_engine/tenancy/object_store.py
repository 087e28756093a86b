"""Which object-storage URLs a namespace's ``task.dataset`` may name, and the credentials
the engine reads them with (never the tenant's).

The pool admin gives the engine prefix templates (``serve --object-store-prefix
s3://datasets/{namespace}/``), an endpoint and a Secret's keys (docs/datasets.md). A
dataset URL is refused unless, as written, it is already in its one normal form and lies
strictly below its namespace's prefix: no percent-encoding, no ``.``/``..`` or empty path
segments, no query, fragment, user or port, only a conservative set of characters; the
bucket matches exactly. So there is nothing for S3 (or a proxy in front of it) to decode
or resolve into another key: the key checked is the key read. Pure, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from loraplex_engine.spec.errors import TaskError, UsageError

FIELD = "spec.task.dataset"
SCHEMES = ("s3", "gs")
NAMESPACE = "{namespace}"
# A scheme, as RFC 3986 spells one: anything that has one is an object URL, not a path.
_HAS_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# S3's (and GCS's, but for '_') bucket names.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
# Key characters S3 documents as safe, but '!', '*', "'", '(' and ')' (glob and shell
# meaning elsewhere) plus '=', '+', ',', '@', '~' (Hive partitions, dates, versions).
_KEY_CHARS = re.compile(r"^[A-Za-z0-9._/=+,@~-]*$")
MAX_URL = 2048
# The engine reads these variables once at start (the pool's Secret, through the pod's
# env) and removes them from its environment, so no process it starts inherits them.
CREDENTIAL_ENV = (
    ("LORAPLEX_S3_ACCESS_KEY_ID", "key"),
    ("LORAPLEX_S3_SECRET_ACCESS_KEY", "secret"),
    ("LORAPLEX_S3_SESSION_TOKEN", "token"),
)


def is_object_url(dataset: str) -> bool:
    """Whether ``dataset`` names object storage (has a scheme) rather than a path."""
    return bool(_HAS_SCHEME.match(dataset))


@dataclass(frozen=True)
class ObjectUrl:
    """A checked URL: ``scheme://bucket/key``, the key without a trailing ``/``."""

    scheme: str
    bucket: str
    key: str

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}"

    @property
    def path(self) -> str:
        """As fsspec names it: ``bucket/key``."""
        return f"{self.bucket}/{self.key}"


def parse_object_url(url: str) -> ObjectUrl | str:
    """The URL in its normal form, or why it is not one (a short phrase)."""
    if len(url) > MAX_URL:
        return f"longer than {MAX_URL} characters"
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES:
        return f"the scheme must be one of {', '.join(s + '://' for s in SCHEMES)}"
    if "%" in rest:
        return "percent-encoding is not allowed"
    bucket, _, key = rest.partition("/")
    if not _BUCKET.match(bucket):
        return f"{bucket!r} is not a bucket name (lowercase letters, digits, '.', '-', '_')"
    if key.endswith("/"):
        key = key[:-1]  # a directory (a saved datasets directory) may be written with one
    if not key:
        return "it names a bucket, not an object"
    if not _KEY_CHARS.match(key):
        return "the key may hold only letters, digits and . _ - / = + , @ ~"
    if any(seg in ("", ".", "..") for seg in key.split("/")):
        return "the key may not hold empty, '.' or '..' segments"
    return ObjectUrl(scheme, bucket, key)


@dataclass(frozen=True)
class ObjectPrefix:
    """One ``--object-store-prefix`` template: ``scheme://bucket/.../{namespace}/.../``."""

    template: str
    scheme: str
    bucket: str
    key_template: str  # ends with '/'

    @classmethod
    def parse(cls, template: str) -> ObjectPrefix:
        parsed = parse_object_url(template.replace(NAMESPACE, "ns"))
        problem = parsed if isinstance(parsed, str) else None
        if template.replace(NAMESPACE, "").count("{"):
            problem = f"the only placeholder is {NAMESPACE}"
        elif problem is None and not template.endswith("/"):
            problem = "it must end with '/'"
        elif problem is None and NAMESPACE not in template.partition("://")[2].partition("/")[2]:
            problem = f"its key must hold {NAMESPACE} (each namespace gets its own prefix)"
        if problem is not None:
            raise UsageError(f"--object-store-prefix {template!r}: {problem}")
        assert isinstance(parsed, ObjectUrl)
        key_template = template.partition("://")[2].partition("/")[2]
        return cls(template, parsed.scheme, parsed.bucket, key_template)

    def key_prefix(self, namespace: str) -> str:
        return self.key_template.replace(NAMESPACE, namespace)

    def shown(self, namespace: str) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key_prefix(namespace)}"

    def admits(self, url: ObjectUrl, namespace: str) -> bool:
        return (
            url.scheme == self.scheme
            and url.bucket == self.bucket
            and (url.key + "/").startswith(self.key_prefix(namespace))
            and url.key + "/" != self.key_prefix(namespace)
        )


@dataclass(frozen=True)
class ObjectStore:
    """The pool's object storage: prefixes, endpoint, region, credentials (hidden from
    repr: they never reach a log or an error)."""

    prefixes: tuple[ObjectPrefix, ...] = ()
    endpoint_url: str | None = None
    region: str | None = None
    credentials: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        prefixes: Iterable[str],
        endpoint_url: str | None = None,
        region: str | None = None,
        credentials: Mapping[str, str] | None = None,
    ) -> ObjectStore:
        parsed = tuple(ObjectPrefix.parse(p) for p in prefixes if p.strip())
        if endpoint_url and not re.match(r"^https?://[^\s/]+/?$", endpoint_url):
            raise UsageError(
                f"--object-store-endpoint {endpoint_url!r}: give http(s)://HOST[:PORT]"
            )
        return cls(parsed, endpoint_url or None, region or None, dict(credentials or {}))

    def check(self, url: str, namespace: str) -> ObjectUrl:
        """The checked URL ``namespace`` may read; TaskError naming the rule if not."""
        if not self.prefixes:
            raise TaskError(
                FIELD,
                "object-storage datasets are not allowed on this engine: its pool has no "
                "objectStore (the pool admin sets one: EnginePool spec.objectStore, "
                "serve --object-store-prefix)",
            )
        parsed = parse_object_url(url)
        if isinstance(parsed, str):
            raise TaskError(FIELD, f"dataset URL {url!r} is not allowed: {parsed}")
        if any(p.admits(parsed, namespace) for p in self.prefixes):
            return parsed
        allowed = " or ".join(p.shown(namespace) for p in self.prefixes)
        raise TaskError(
            FIELD,
            f"dataset URL {url!r} is not allowed: namespace {namespace}'s datasets must lie "
            f"under {allowed}",
        )


def credentials_from(environ: dict[str, str]) -> dict[str, str]:
    """The credential variables of ``environ``, removed from it: fsspec's names for them."""
    found = {}
    for var, name in CREDENTIAL_ENV:
        value = environ.pop(var, "").strip()
        if value:
            found[name] = value
    return found
