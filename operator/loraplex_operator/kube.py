"""A thin async Kubernetes client (httpx) for the reconciler.

kopf watches and patches through its own client; the reconciler needs a few plain
reads and writes (list experiments, list and create engine Pods, read the token Secret,
patch status). This client uses the same credentials kopf would: the in-cluster service
account first, else the current context of `KUBECONFIG` (or `~/.kube/config`), through
kopf's own `login_with_service_account` / `login_with_kubeconfig`.

Label selectors are sent to the API server *and* applied again here, so the code also
works against API mocks that ignore them (kmock).
"""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from loraplex_operator.resources import EXPERIMENT_PLURAL, GROUP, POOL_PLURAL, VERSION


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


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def labels_match(obj: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    have = obj.get("metadata", {}).get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items())


def _write_temp(data: str | bytes, suffix: str) -> str:
    raw = base64.b64decode(data) if isinstance(data, str) else data
    fd, path = tempfile.mkstemp(suffix=suffix)
    with os.fdopen(fd, "wb") as f:
        f.write(raw)
    return path


def _ssl_context(info: Any) -> ssl.SSLContext | bool:
    server = str(info.server or "")
    if not server.startswith("https"):
        return True
    if info.insecure:
        return False
    ctx = ssl.create_default_context()
    if info.ca_path:
        ctx.load_verify_locations(cafile=os.fspath(info.ca_path))
    elif info.ca_data:
        pem = base64.b64decode(info.ca_data).decode()
        ctx.load_verify_locations(cadata=pem)
    cert = info.certificate_path or (
        _write_temp(info.certificate_data, ".crt") if info.certificate_data else None
    )
    key = info.private_key_path or (
        _write_temp(info.private_key_data, ".key") if info.private_key_data else None
    )
    if cert:
        ctx.load_cert_chain(os.fspath(cert), os.fspath(key) if key else None)
    return ctx


class Kube:
    """A handful of typed calls against the API server (JSON in, JSON out)."""

    def __init__(
        self,
        server: str,
        *,
        token: str | None = None,
        verify: ssl.SSLContext | bool = True,
        auth: tuple[str, str] | None = None,
        timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
        user_agent: str = USER_AGENT,
    ) -> None:
        headers = {"Accept": "application/json", "User-Agent": user_agent}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.AsyncClient(
            base_url=server.rstrip("/"),
            headers=headers,
            verify=verify,
            auth=auth,
            timeout=timeout,
            transport=transport,
        )

    @classmethod
    def from_connection_info(cls, info: Any, **kw: Any) -> Kube:
        """Build from a `kopf.ConnectionInfo`."""
        auth = (info.username, info.password) if info.username and info.password else None
        return cls(info.server, token=info.token, verify=_ssl_context(info), auth=auth, **kw)

    @classmethod
    def from_environment(cls, settings: Any, **kw: Any) -> Kube:
        import kopf

        info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(
            settings=settings
        )
        if info is None:
            raise RuntimeError("no Kubernetes credentials: neither in-cluster nor KUBECONFIG")
        return cls.from_connection_info(info, **kw)

    async def close(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, **kw: Any) -> Any:
        r = await self._http.request(method, path, **kw)
        if r.status_code >= 400:
            try:
                message = r.json().get("message", r.text)
            except ValueError:
                message = r.text
            raise KubeError(r.status_code, f"{method} {path}: {message}")
        return r.json() if r.content else None

    async def list(
        self,
        res: Resource,
        namespace: str | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        params = {}
        if labels:
            params["labelSelector"] = ",".join(f"{k}={v}" for k, v in labels.items())
        body = await self._request("GET", res.path(namespace), params=params)
        items = [i for i in (body or {}).get("items", []) if i]
        if namespace and res.namespaced:  # a mock may answer cluster-wide
            items = [i for i in items if i.get("metadata", {}).get("namespace") == namespace]
        return [i for i in items if labels_match(i, labels or {})]

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
        return await self._request("POST", res.path(namespace), json=dict(body))

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
                json=dict(patch),
                headers={"Content-Type": MERGE_PATCH},
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
        params = {} if grace_seconds is None else {"gracePeriodSeconds": str(grace_seconds)}
        try:
            await self._request("DELETE", res.path(namespace, name), params=params)
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
