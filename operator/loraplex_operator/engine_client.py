"""Async client for the engine HTTP API (docs/engine-api.md), bearer token per pool."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from loraplex_operator.logs import quiet_libraries

# httpx logs every request at INFO; the operator polls each engine every few seconds, so
# those lines would be nearly all of its log. Its warnings still show.
quiet_libraries()


class EngineError(Exception):
    """A 4xx/5xx answer from an engine, with the engine's error code and field."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(f"{status} {code}: {message}" + (f" ({field})" if field else ""))
        self.status = status
        self.code = code
        self.message = message
        self.field = field


class EngineUnreachable(Exception):
    """The engine did not answer (connection refused, timeout)."""


class EngineClient:
    def __init__(
        self, timeout: float = 30.0, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self._http = httpx.AsyncClient(timeout=timeout, transport=transport)

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(
        self,
        method: str,
        url: str,
        token: str | None,
        json: Any = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        kw: dict[str, Any] = {"headers": headers}
        if json is not None:
            kw["json"] = json
        if timeout is not None:
            kw["timeout"] = timeout
        try:
            return await self._http.request(method, url, **kw)
        except httpx.TransportError as e:
            raise EngineUnreachable(f"{method} {url}: {e!r}") from e

    @staticmethod
    def _raise(r: httpx.Response) -> None:
        if r.status_code < 400:
            return
        try:
            err = r.json().get("error") or {}
        except ValueError:
            err = {}
        raise EngineError(
            r.status_code,
            str(err.get("code") or "http_error"),
            str(err.get("message") or r.text[:500]),
            err.get("field"),
        )

    async def capacity(self, base: str, token: str) -> dict[str, Any]:
        r = await self._call("GET", f"{base}/v1/capacity", token)
        self._raise(r)
        return r.json()

    async def list(self, base: str, token: str) -> list[dict[str, Any]]:
        r = await self._call("GET", f"{base}/v1/experiments", token)
        self._raise(r)
        return list(r.json().get("experiments", []))

    async def put(
        self,
        base: str,
        token: str,
        exp_id: str,
        spec: Mapping[str, Any],
        namespace: str,
        name: str,
        resume_from: str | None = None,
        run_id: str | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """Start or resume. (201, status) new, (200, status) already loaded with this spec.

        ``run_id`` (the LoRAExperiment's uid) names the run: its checkpoints' directory,
        and without ``resume_from`` the engine resumes that run's newest checkpoint."""
        body: dict[str, Any] = {
            "spec": dict(spec),
            "namespace": namespace,
            "name": name,
            "resumeFrom": resume_from,
        }
        if run_id is not None:
            body["runId"] = run_id
        r = await self._call("PUT", f"{base}/v1/experiments/{exp_id}", token, json=body)
        self._raise(r)
        return r.status_code, r.json()

    async def put_publish(
        self, base: str, token: str, exp_id: str, publish: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        """Replace a loaded experiment's spec.publish in place; its new status."""
        body = {"publish": None if publish is None else dict(publish)}
        r = await self._call("PUT", f"{base}/v1/experiments/{exp_id}/publish", token, json=body)
        self._raise(r)
        return r.json()

    async def delete(
        self, base: str, token: str, exp_id: str, timeout: float = 120.0
    ) -> dict[str, Any] | None:
        """Checkpoint, then unload. The final status, or None if it was not loaded."""
        r = await self._call("DELETE", f"{base}/v1/experiments/{exp_id}", token, timeout=timeout)
        if r.status_code == 404:
            return None
        self._raise(r)
        return r.json()
