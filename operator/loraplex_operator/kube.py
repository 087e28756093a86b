"""The reconciler's Kubernetes reads and writes, on `kubernetes_asyncio` (the official
client's async port).

kopf watches and patches through its own client; the reconciler needs a few plain reads
and writes (the engine token Secret, engine Pods, status patches). The client library
owns the credentials: the in-cluster service account (it re-reads the projected token
file, which the kubelet rotates), else the current context of `KUBECONFIG` (or
`~/.kube/config`) with everything a kubeconfig can say: tokens and token files, client
certificates (written to a temporary directory removed on `close`), and `exec` plugins
(EKS, GKE, AKS). This adapter adds what a controller needs on top:

- on 401, credentials are loaded again once and the request retried (a rotated token,
  an exec credential that expired);
- 429 and 5xx are retried with exponential backoff, honouring `Retry-After`;
- lists are paginated (`limit` / `continue`);
- label selectors are left to the API server.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import random
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from loraplex_operator.resources import EXPERIMENT_PLURAL, GROUP, POOL_PLURAL, VERSION

log = logging.getLogger("loraplex_operator.kube")


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None = None, name: str | None = None, sub: str = "") -> str:
        base = f"/api/{self.version}" if not self.group else f"/apis/{self.group}/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
        if sub:
            base += f"/{sub}"
        return base

    @property
    def kopf_resource(self) -> tuple[str, str, str]:
        """(group, version, plural), as kopf's handler decorators take it."""
        return self.group, self.version, self.plural


EXPERIMENTS = Resource(GROUP, VERSION, EXPERIMENT_PLURAL)
POOLS = Resource(GROUP, VERSION, POOL_PLURAL, namespaced=False)
PODS = Resource("", "v1", "pods")
SECRETS = Resource("", "v1", "secrets")
NAMESPACES = Resource("", "v1", "namespaces", namespaced=False)

MERGE_PATCH = "application/merge-patch+json"
USER_AGENT = "loraplex-operator/0.1.0"
PAGE_SIZE = 500
RETRIED = frozenset({429, 500, 502, 503, 504})


SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def _message(e: ApiException) -> str:
    try:
        return str(json.loads(e.body or "{}").get("message") or e.reason)
    except (ValueError, AttributeError):
        return str(e.body or e.reason)


def backoff(attempt: int, base: float = 0.5, cap: float = 30.0) -> float:
    """Exponential backoff with jitter before retry `attempt` (0-based)."""
    return min(cap, base * 2**attempt) * (0.5 + random.random() / 2)


def retry_after(e: ApiException, attempt: int, cap: float = 30.0) -> float:
    """Seconds to wait before retry `attempt`: the server's `Retry-After` when it sends
    one (in seconds; 429 and 503 do), else `backoff`."""
    header = (e.headers or {}).get("Retry-After")
    if header is not None:
        try:
            return min(max(float(header), 0.0), cap)
        except ValueError:
            pass
    return backoff(attempt, cap=cap)


class Kube:
    """A handful of typed calls against the API server (JSON in, JSON out).

    `Kube()` loads credentials from the environment (in-cluster, else the kubeconfig);
    `Kube(server, token=...)` talks to one server (the tests' API server).
    """

    def __init__(
        self,
        server: str | None = None,
        *,
        token: str | None = None,
        user_agent: str = USER_AGENT,
        timeout: float = 30.0,
        max_retries: int = 6,
    ) -> None:
        self._server = server
        self._token = token
        self._user_agent = user_agent
        self._timeout = timeout
        self._max_retries = max_retries
        self._api: client.ApiClient | None = None
        self._lock = asyncio.Lock()
        self._files = tempfile.TemporaryDirectory(prefix="loraplex-kube-")

    @classmethod
    def from_environment(cls, settings: Any = None, **kw: Any) -> Kube:
        """Credentials as kopf finds them: in-cluster first, else `KUBECONFIG`. (`settings`,
        kopf's, is accepted for callers that have one; the client library needs none.)"""
        return cls(**kw)

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
            self._api = None
        self._files.cleanup()

    # -- credentials --

    async def _client(self, stale: client.ApiClient | None = None) -> client.ApiClient:
        """The API client; a new one (credentials read again) when `stale` is current."""
        async with self._lock:
            if self._api is not None and self._api is not stale:
                return self._api
            if self._api is not None:
                await self._api.close()
            cfg = await self._configuration()
            self._api = client.ApiClient(cfg)
            self._api.user_agent = self._user_agent
            return self._api

    async def connection_info(self) -> Any:
        """Credentials read afresh, as a `kopf.ConnectionInfo`, so that kopf's watches and
        patches authenticate as this client does (kopf's own kubeconfig login knows neither
        `tokenFile` nor `exec`). kopf asks again after a 401."""
        import kopf

        cfg, namespace = await self._configuration_and_namespace()
        header = await cfg.get_api_key_with_prefix("BearerToken") or ""
        scheme, _, token = header.partition(" ")
        return kopf.ConnectionInfo(
            server=cfg.host,
            ca_path=cfg.ssl_ca_cert or None,
            insecure=True if not cfg.verify_ssl else None,
            scheme=scheme or None,
            token=token or None,
            certificate_path=cfg.cert_file or None,
            private_key_path=cfg.key_file or None,
            default_namespace=namespace,
        )

    async def _configuration(self) -> client.Configuration:
        return (await self._configuration_and_namespace())[0]

    async def _configuration_and_namespace(self) -> tuple[client.Configuration, str | None]:
        """The client configuration and the default namespace of the credentials."""
        cfg = client.Configuration()
        if self._server is not None:
            cfg.host = self._server.rstrip("/")
            if self._token:
                cfg.api_key["BearerToken"] = f"Bearer {self._token}"
            return cfg, None
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            try:
                config.load_incluster_config(client_configuration=cfg)
                return cfg, _read(SERVICE_ACCOUNT_NAMESPACE)
            except config.ConfigException as e:
                log.info("not in a cluster (%s); trying the kubeconfig", e)
        try:
            loader = await config.load_kube_config(
                client_configuration=cfg, persist_config=False, temp_file_path=self._files.name
            )
        except (config.ConfigException, OSError) as e:
            raise RuntimeError(
                f"no Kubernetes credentials: neither in-cluster nor KUBECONFIG ({e})"
            ) from e
        if "BearerToken" in cfg.api_key:  # a token file may end in a newline (kubectl strips it)
            cfg.api_key["BearerToken"] = cfg.api_key["BearerToken"].strip()
        context = (loader.current_context or {}).get("context") or {}
        return cfg, context.get("namespace")

    # -- requests --

    async def _request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Any:
        api = await self._client()
        reloaded = False
        attempt = 0
        while True:
            try:
                return await api.call_api(
                    path,
                    method,
                    query_params=list((query or {}).items()),
                    header_params={"Accept": "application/json", "Content-Type": content_type},
                    body=body,
                    response_types_map={200: "object", 201: "object", 202: "object"},
                    auth_settings=["BearerToken"],
                    _return_http_data_only=True,
                    _request_timeout=self._timeout,
                )
            except ApiException as e:
                if e.status == 401 and not reloaded:
                    log.info("%s %s: 401, loading credentials again", method, path)
                    api = await self._client(stale=api)
                    reloaded = True
                    continue
                if e.status in RETRIED and attempt < self._max_retries:
                    delay = retry_after(e, attempt)
                    log.info("%s %s: %s, retrying in %.1fs", method, path, e.status, delay)
                    await asyncio.sleep(delay)
                    attempt += 1
                    continue
                raise KubeError(e.status or 0, f"{method} {path}: {_message(e)}") from e
            except (aiohttp.ClientError, TimeoutError) as e:
                if attempt >= self._max_retries:
                    raise KubeError(0, f"{method} {path}: {e!r}") from e
                await asyncio.sleep(backoff(attempt))
                attempt += 1

    async def list(
        self,
        res: Resource,
        namespace: str | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        """Every object, page by page (`limit`/`continue`); `labels` is a selector."""
        query: dict[str, str] = {"limit": str(PAGE_SIZE)}
        if labels:
            query["labelSelector"] = ",".join(f"{k}={v}" for k, v in labels.items())
        items: list[dict[str, Any]] = []
        while True:
            body = await self._request("GET", res.path(namespace), query=query) or {}
            items.extend(i for i in body.get("items") or [] if i)
            token = (body.get("metadata") or {}).get("continue")
            if not token:
                return items
            query["continue"] = token

    async def get(
        self, res: Resource, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None:
        try:
            return await self._request("GET", res.path(namespace, name))
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    async def create(
        self, res: Resource, body: Mapping[str, Any], namespace: str | None = None
    ) -> dict[str, Any]:
        return await self._request("POST", res.path(namespace), body=dict(body))

    async def patch(
        self,
        res: Resource,
        name: str,
        patch: Mapping[str, Any],
        namespace: str | None = None,
        subresource: str = "",
    ) -> dict[str, Any] | None:
        """JSON merge patch (`null` removes a field). None when the object is gone."""
        try:
            return await self._request(
                "PATCH",
                res.path(namespace, name, subresource),
                body=dict(patch),
                content_type=MERGE_PATCH,
            )
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    async def delete(
        self,
        res: Resource,
        name: str,
        namespace: str | None = None,
        grace_seconds: int | None = None,
    ) -> bool:
        """True when deleted (or being deleted), False when it was not there.

        `grace_seconds` overrides the object's grace period (0 = at once; a Pod's
        containers are then killed without waiting for them to stop)."""
        query = {} if grace_seconds is None else {"gracePeriodSeconds": str(grace_seconds)}
        try:
            await self._request("DELETE", res.path(namespace, name), query=query)
            return True
        except KubeError as e:
            if e.status == 404:
                return False
            raise

    async def secret_value(self, namespace: str, name: str, key: str) -> str | None:
        secret = await self.get(SECRETS, name, namespace)
        if not secret:
            return None
        if key in (secret.get("data") or {}):
            return base64.b64decode(secret["data"][key]).decode().strip()
        value = (secret.get("stringData") or {}).get(key)
        return value.strip() if value else None
