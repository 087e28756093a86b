"""The operator's API client (`kube.Kube`, on kubernetes_asyncio) against the kmock API
server: pages through long lists, leaves label selectors to the server, waits out 429s
as the server asks, and gives up on a refused token after loading credentials once."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import kmock
import pytest
from loraplex_operator import kube as kube_module
from loraplex_operator.kube import PODS, Kube, KubeError

from tests.support.harness import ENGINE_NS, ApiServer, declare_resources


class ThrottlingApiServer(ApiServer):
    """Answers the first `throttled` requests 429 with `Retry-After`."""

    throttled = 0
    retry_after = "0"

    async def _handle(self, request: Any) -> Any:
        if self.throttled > 0:
            self.throttled -= 1
            error = kmock.KubernetesError(status=429, reason="TooManyRequests", message="slow")
            response = await self._render_error(error)
            response.headers["Retry-After"] = self.retry_after
            return response
        return await super()._handle(request)


@pytest.fixture
async def server() -> AsyncIterator[tuple[ThrottlingApiServer, str]]:
    api = ThrottlingApiServer()
    declare_resources(api)
    async with api, kmock.Server(api) as srv:
        yield api, str(srv.url).rstrip("/")


def _pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": ENGINE_NS, "labels": labels}}


async def test_lists_page_by_page_and_the_server_selects_labels(
    server: tuple[ThrottlingApiServer, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    api, url = server
    kube = Kube(url)
    try:
        for i in range(7):
            await kube.create(PODS, _pod(f"p{i}", {"pool": "a" if i % 2 else "b"}), ENGINE_NS)
        monkeypatch.setattr(kube_module, "PAGE_SIZE", 2)
        before = len(list(api))
        everything = await kube.list(PODS, ENGINE_NS)
        pool_a = await kube.list(PODS, ENGINE_NS, labels={"pool": "a"})
    finally:
        await kube.close()
    assert sorted(p["metadata"]["name"] for p in everything) == [f"p{i}" for i in range(7)]
    assert sorted(p["metadata"]["name"] for p in pool_a) == ["p1", "p3", "p5"]
    lists = list(api)[before:]
    assert len(lists) == 4 + 2  # 7 pods in pages of 2, then 3 selected ones
    assert all(r.params.get("limit") == "2" for r in lists)
    assert [r.params.get("continue") for r in lists[:4]] == [None, "2", "4", "6"]
    assert all(r.params.get("labelSelector") == "pool=a" for r in lists[4:])


async def test_429_is_retried_after_what_the_server_asks(
    server: tuple[ThrottlingApiServer, str],
) -> None:
    api, url = server
    kube = Kube(url)
    try:
        await kube.create(PODS, _pod("p", {}), ENGINE_NS)
        api.throttled, api.retry_after = 2, "1.0"
        before, t0 = len(list(api)), time.monotonic()
        pod = await kube.get(PODS, "p", ENGINE_NS)
        waited = time.monotonic() - t0
    finally:
        await kube.close()
    assert pod is not None and pod["metadata"]["name"] == "p"
    assert len(list(api)) - before == 3
    assert waited >= 2.0  # twice Retry-After; the client's own backoff would be <= 1.5 s


async def test_a_refused_token_fails_after_one_reload(
    server: tuple[ThrottlingApiServer, str],
) -> None:
    api, url = server
    api.tokens = {"good"}
    kube = Kube(url, token="bad")
    try:
        before = len(list(api))
        with pytest.raises(KubeError, match=r"^401: GET"):
            await kube.get(PODS, "p", ENGINE_NS)
    finally:
        await kube.close()
    assert len(list(api)) - before == 2  # the request, and once more with credentials reloaded
