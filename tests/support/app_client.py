"""The in-process HTTP app's side of a test: its bearer token and a PUT of an experiment
through a `TestClient` (a small spec unless one is given)."""

from __future__ import annotations

import httpx

from tests.support.server_specs import small_spec

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def put(client, exp_id: str, spec=None, **extra) -> httpx.Response:
    name = exp_id.split(".", 1)[-1]
    body = {"spec": spec or small_spec(rank=4), "namespace": "default", "name": name, **extra}
    return client.put(f"/v1/experiments/{exp_id}", json=body, headers=AUTH)
