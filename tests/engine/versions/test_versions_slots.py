"""The version slot cache on a real ``loraplex-engine serve`` process (versions/slot_cache.py,
docs/versions.md "Serving"): a version served twice is loaded once (the server's log
line per load counts them), an alias flip serves the new version's weights at once, and
resident versions give their slots back to training experiments placed after them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
from loraplex_engine.store.versions import VersionStore

from tests.support.server_process import EngineServer, wait_until
from tests.support.server_specs import put_body, small_spec

EXP = "demo.cont"


def _loads(srv: EngineServer, version: str) -> int:
    pattern = re.compile(rf"version {re.escape(EXP)}@{version}#[0-9a-f]{{16}} loaded into slot")
    return len(pattern.findall(srv.log_text()))


def _evictions(srv: EngineServer) -> int:
    return len(re.findall(r"version \S+ evicted from its slot", srv.log_text()))


def _by_content(store: VersionStore) -> dict[str, int]:
    """Published versions by content hash (the newest of equal ones)."""
    listed = store.list("demo", "cont")
    return {store.read("demo", "cont", n).content_hash: n for n in listed}


def _complete(api: httpx.Client, model: str) -> tuple[list[str], list[float]]:
    body = {"model": model, "prompt": "the answer is", "max_tokens": 5, "temperature": 0,
            "logprobs": 0}  # fmt: skip
    r = api.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def _alias(api: httpx.Client, version: str) -> None:
    publish: dict[str, Any] = {"keep": 100, "aliases": [{"name": "canary", "version": version}]}
    r = api.put(f"/v1/experiments/{EXP}/publish", json={"publish": publish})
    assert r.status_code == 200 and r.json()["aliases"]["canary"] == version, r.text


def test_a_served_version_stays_resident_and_a_flip_serves_the_new_one(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    # One training experiment, two spare slots.
    srv = EngineServer(tiny_model_dir, root, max_adapters=3, workdir=tmp_path)
    with srv, srv.client() as api:
        spec = small_spec(max_steps=0) | {"publish": {"everySteps": 1, "keep": 100}}
        assert api.put(f"/v1/experiments/{EXP}", json=put_body(EXP, spec)).status_code == 201
        store = VersionStore(root)
        # Two versions of other weights (a step whose group rewards all tie changes none).
        wait_until(lambda: len(_by_content(store)) >= 2, timeout=120)
        _alias(api, "v1")  # and no more publishing
        other = f"v{max(_by_content(store).values())}"  # its weights differ from v1's
        first = _complete(api, f"{EXP}:canary")
        assert _loads(srv, "v1") == 1
        assert _complete(api, f"{EXP}:canary") == first  # resident: served, not reloaded
        assert _complete(api, f"{EXP}@v1") == first  # the same version by number: the same slot
        assert _loads(srv, "v1") == 1
        # The flip: the alias resolves to v2's own name; its weights serve at once.
        _alias(api, other)
        flipped = _complete(api, f"{EXP}:canary")
        assert _loads(srv, other) == 1
        assert flipped == _complete(api, f"{EXP}@{other}") and flipped != first
        assert (_loads(srv, "v1"), _loads(srv, other)) == (1, 1)  # both resident, no reload
        capacity = api.get("/v1/capacity").json()
        assert capacity["versionLoads"] == 2 and len(capacity["residentVersions"]) == 2
        assert capacity["freeSlots"] == 2  # resident versions give their slots back
        metrics = api.get("/metrics").text
        assert re.search(r"^loraplex_engine_version_loads_total 2\.0$", metrics, re.M)
        assert re.search(r"^loraplex_engine_resident_versions 2\.0$", metrics, re.M)
        # Training experiments placed now take the resident versions' slots.
        assert _evictions(srv) == 0
        for other in ("demo.b", "demo.c"):
            r = api.put(f"/v1/experiments/{other}", json=put_body(other, small_spec(max_steps=0)))
            assert r.status_code == 201, r.text
        assert _evictions(srv) == 2
        r = api.post("/v1/completions", json={"model": f"{EXP}@v1", "prompt": "x", "max_tokens": 2})
        assert r.status_code != 200 and "slot" in r.text  # no spare slot left: refused
