"""A pool's names for its base model (EnginePool spec.servedModelNames): on the engine's
command line, in the CRD's checks, and in the gateway's routing by base_model."""

from __future__ import annotations

import pytest
from loraplex_operator.api.pool import EnginePoolSpec
from loraplex_operator.gateway import experiments as gx
from loraplex_operator.gateway.routing import Engine
from loraplex_operator.gateway.served_names import names_of

from tests.support.builders import pool, serve_args
from tests.support.crdkit import admit

SNAPSHOT = "/models/hub/models--Qwen--Qwen3-8B/snapshots/abc123"
SESSION = "s" + "0" * 20


def _spec(**extra: object) -> EnginePoolSpec:
    return EnginePoolSpec.from_obj({**pool().obj()["spec"], **extra})


def test_the_pools_names_reach_the_engine_as_served_model_names() -> None:
    spec = {**pool().obj()["spec"], "servedModelNames": ["Qwen/Qwen3-8B", "base"]}
    args = serve_args(spec)
    assert [a for a in args if a.startswith("--served-model-name")] == [
        "--served-model-name=Qwen/Qwen3-8B",
        "--served-model-name=base",
    ]
    assert not any(a.startswith("--served-model-name") for a in serve_args(pool().obj()["spec"]))


@pytest.mark.parametrize("bad", ["a/b/c", "Qwen/Qwen3-8B:tag", "/abs", "a b", ""])
def test_the_crd_refuses_a_name_no_client_could_send(bad: str) -> None:
    obj = pool().set("spec.servedModelNames", [bad]).obj()
    assert any("servedModelNames" in e for e in admit("EnginePool", obj)), bad
    good = pool().set("spec.servedModelNames", ["Qwen/Qwen3-8B", "tiny-llama"]).obj()
    assert admit("EnginePool", good) == []


def test_the_gateway_routes_by_every_name_the_engines_take() -> None:
    assert names_of(_spec()) == ("tiny-llama",)
    assert names_of(_spec(baseModel=SNAPSHOT)) == ("Qwen/Qwen3-8B", "abc123")
    given = names_of(_spec(servedModelNames=["acme/base"]))
    assert given == ("acme/base", "tiny-llama")
    e = Engine("e", "p", "http://e", "t", base_model=given[0], served_names=given)
    assert e.serves("acme/base:tag") and e.serves("tiny-llama") and not e.serves("Qwen/Qwen3-8B")


def test_a_base_sampler_of_a_hub_id_round_trips_through_its_id() -> None:
    sid = gx.base_sampler_id(SESSION, 3, "Qwen/Qwen3-8B")
    assert sid is not None and "/" not in sid
    assert gx.split_base_sampler(sid) == (SESSION, "Qwen/Qwen3-8B")
