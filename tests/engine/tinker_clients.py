"""The official tinker SDK's ServiceClient for tests, closed when the test ends
(tests/conftest.py): an open client keeps a heartbeat thread and its event loop alive for
the rest of the pytest process, logging into closed streams once its server is gone."""

from __future__ import annotations

import contextlib

import tinker

OPEN: list[tinker.ServiceClient] = []


def service_client(url: str, key: str | None = None) -> tinker.ServiceClient:
    client = tinker.ServiceClient(base_url=url, api_key=key)
    OPEN.append(client)
    return client


def close_all() -> None:
    """Close every client a test opened (a closed or unreachable one is fine)."""
    while OPEN:
        client = OPEN.pop()
        with contextlib.suppress(Exception):
            client.close("success").result(timeout=10)
