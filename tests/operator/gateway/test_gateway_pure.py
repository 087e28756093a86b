"""The gateway's pure parts: keys from labelled Secrets (digests, roles, constant-time
lookup), model-id resolution within a namespace, Tinker ids to sessions, future ids,
the engine choice, the protobuf model id, the pool's namespace rules, the engine list."""

from __future__ import annotations

import base64

import pytest
from loraplex_operator.api.pool import LabelSelector
from loraplex_operator.gateway import routing
from loraplex_operator.gateway.directory import file_secrets, pool_engines
from loraplex_operator.gateway.keys import (
    KEY_LABEL,
    ROLE_LABEL,
    Key,
    KeyTable,
    digest,
    parse_secret,
    presented_key,
)
from loraplex_operator.gateway.routing import Engine
from loraplex_operator.gateway.tinker import CLIENT_CONFIG
from loraplex_operator.resources import Pool

from tests.support import builders

KEY_A = "tml-aaaaaaaaaaaaaaaaaaaaaaaa"
KEY_B = "tml-bbbbbbbbbbbbbbbbbbbbbbbb"


def secret(ns: str, key: str, role: str | None = None, encoded: bool = True) -> dict:
    labels = {KEY_LABEL: "true", **({ROLE_LABEL: role} if role else {})}
    meta = {"namespace": ns, "name": f"k-{ns}", "labels": labels}
    if encoded:
        return {"metadata": meta, "data": {"key": base64.b64encode(key.encode()).decode()}}
    return {"metadata": meta, "stringData": {"key": key}}


def test_a_secret_is_a_digest_its_namespace_and_a_role_sample_by_default() -> None:
    k = parse_secret(secret("team-a", KEY_A, "train"))
    assert k == Key(digest(KEY_A), "team-a", "train", "k-team-a")
    assert parse_secret(secret("team-a", KEY_A)).role == "sample"
    hashed = parse_secret(secret("team-b", f"sha256:{digest(KEY_B).hex()}", encoded=False))
    assert isinstance(hashed, Key) and hashed.digest == digest(KEY_B)
    assert "role" in parse_secret(secret("team-a", KEY_A, "admin"))
    assert "tml-" in parse_secret(secret("team-a", "tml-short"))
    assert "tml-" in parse_secret({"metadata": {"namespace": "a", "name": "x"}, "data": {}})


def test_lookup_finds_the_key_and_nothing_else() -> None:
    table, problems = KeyTable.from_secrets(
        [secret("team-a", KEY_A, "train"), secret("team-b", KEY_B), secret("x", "bad")]
    )
    assert len(table) == 2 and len(problems) == 1
    assert table.lookup(KEY_A).namespace == "team-a"
    assert table.lookup(KEY_B).role == "sample"
    assert table.lookup(KEY_A + "x") is None
    assert table.lookup(None) is None and table.lookup("") is None
    assert table.lookup(f"sha256:{digest(KEY_A).hex()}") is None  # a digest is no key


def test_roles_a_sample_key_samples_a_train_key_trains() -> None:
    sample = Key(b"", "a", "sample", "s")
    train = Key(b"", "a", "train", "t")
    for route in ("create_model", "forward_backward", "forward", "optim_step", "save_weights"):
        assert not sample.may(route) and train.may(route)
    for route in ("create_session", "asample", "retrieve_future", "create_sampling_session"):
        assert sample.may(route)
    # A sample key polls its sampling sessions and cancels its own samples.
    for route in ("retrieve_futures", "cancel_future"):
        assert sample.may(route) and train.may(route)


def test_the_presented_key_is_x_api_key_or_a_bearer_token() -> None:
    assert presented_key({"x-api-key": KEY_A}) == KEY_A
    assert presented_key({"authorization": f"Bearer {KEY_B}"}) == KEY_B
    assert presented_key({"authorization": f"bearer  {KEY_B} "}) == KEY_B
    assert presented_key({"authorization": "Basic x"}) is None


def test_openai_ids_resolve_within_the_keys_namespace() -> None:
    assert routing.openai_model("team-a", "exp") == "team-a.exp"
    assert routing.openai_model("team-a", "team-a.exp") == "team-a.exp"
    # another namespace's id is a name in this one: never reaches team-b
    assert routing.openai_model("team-a", "team-b.exp") == "team-a.team-b.exp"
    cards = [{"id": "base"}, {"id": "team-a.x"}, {"id": "team-b.y"}, {"id": "team-a.x"}]
    assert [c["id"] for c in routing.namespace_models("team-a", cards)] == ["team-a.x"]


def test_tinker_ids_carry_their_session() -> None:
    assert routing.session_of("s123") == "s123"
    assert routing.session_of("s123:train:0") == "s123"
    assert routing.session_of("s123:sample:ab") == "s123"
    assert routing.session_of("tinker://s123:train:2/weights/w1") == "s123"
    assert routing.session_of(None) is None and routing.session_of("") is None


def test_future_ids_name_their_engine() -> None:
    fid = routing.future_id("p-engine-abc", "f00d")
    assert routing.split_future_id(fid) == ("p-engine-abc", "f00d")
    assert routing.split_future_id("f00d") is None
    answer = routing.with_future_ids("e1", {"request_id": "r1", "model_id": None})
    assert answer == {"request_id": "e1~r1", "model_id": None}
    assert routing.with_future_ids("e1", answer) == answer
    assert routing.with_future_ids("e1", [1]) == [1]


def test_a_new_session_goes_where_most_slots_are_free() -> None:
    assert routing.pick_engine({"b": 2, "a": 2, "c": 1}) == "a"
    assert routing.pick_engine({"a": 0, "b": 3}) == "b"
    assert routing.pick_engine({"a": 0}) is None and routing.pick_engine({}) is None


def test_an_engine_s_room_is_what_it_registers_where_it_pages() -> None:
    full_slots = {"freeSlots": 0, "usedSlots": 8, "maxRegistered": 512, "pagedAdapters": 100}
    assert routing.registered_room(full_slots) == 404  # its slots are full, it pages
    full = {"freeSlots": 0, "usedSlots": 8, "maxRegistered": 512, "pagedAdapters": 504}
    assert routing.registered_room(full) == 0
    no_paging = {"freeSlots": 3, "usedSlots": 5}  # an engine built before paging
    assert routing.registered_room(no_paging) == 3
    assert routing.registered_room({"maxRegistered": "9", "freeSlots": 1}) == 1  # not a count
    assert routing.registered_room({}) == 0


def test_the_protobuf_model_id_is_read_from_the_wire() -> None:
    from tinker.proto import tinker_public_pb2 as pb

    msg = pb.ForwardBackwardRequest(model_id="s1:train:0", seq_id=7, loss_fn="ppo")
    body = msg.SerializeToString()
    assert routing.proto_string_field(body, 1) == "s1:train:0"
    reordered = pb.ForwardBackwardRequest(seq_id=3).SerializeToString() + body
    assert routing.proto_string_field(reordered, 1) == "s1:train:0"
    assert routing.proto_string_field(b"\x0a\x40abc", 1) is None  # truncated
    assert routing.proto_string_field(b"", 1) is None


def test_pools_admit_as_the_operator_admits() -> None:
    everyone = Engine("e", "p", "u", "t")
    listed = Engine("e", "p", "u", "t", allowed_namespaces=("team-a",))
    nobody = Engine("e", "p", "u", "t", allowed_namespaces=())
    selected = Engine(
        "e",
        "p",
        "u",
        "t",
        namespace_selector=LabelSelector.model_validate({"matchLabels": {"t": "1"}}),
    )
    assert everyone.admits("x") and listed.admits("team-a") and not listed.admits("team-b")
    assert not nobody.admits("team-a")
    assert selected.admits("z", {"t": "1"}) and not selected.admits("z", {})


def _pod(name: str, ready: bool, ip: str | None = "10.0.0.1", deleting: bool = False) -> dict:
    meta = {"name": name, **({"deletionTimestamp": "2030-01-01T00:00:00Z"} if deleting else {})}
    status = {"phase": "Running", "podIP": ip}
    status["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
    return {"metadata": meta, "spec": {}, "status": status}


def test_a_pools_engines_are_its_ready_live_pods() -> None:
    pool = Pool.from_obj(builders.pool("p").allowed_namespaces("team-a").obj())
    pods = [
        _pod("p-engine-b", True),
        _pod("p-engine-a", True, "10.0.0.2"),
        _pod("p-engine-c", False),
    ]
    pods.append(_pod("p-engine-d", True, deleting=True))
    engines = pool_engines(pool, pods, "secret-token")
    assert [(e.name, e.url) for e in engines] == [
        ("p-engine-a", "http://10.0.0.2:8000"),
        ("p-engine-b", "http://10.0.0.1:8000"),
    ]
    assert engines[0].token == "secret-token" and engines[0].allowed_namespaces == ("team-a",)
    # The name the engines serve the base model by: `serve --model <dir>` names it <dir>'s.
    base = pool.spec.base_model.rstrip("/").rsplit("/", 1)[-1]
    assert engines[0].base_model == base and base
    assert pool_engines(pool, pods, None) == []  # no token: nothing to call them with


def test_a_files_keys_are_the_secrets_they_stand_for() -> None:
    table, problems = KeyTable.from_secrets(
        file_secrets([{"namespace": "team-a", "key": KEY_A, "role": "train"}])
    )
    assert not problems and table.lookup(KEY_A).role == "train"


def test_the_client_config_is_the_engines_but_uncompressed() -> None:
    pytest.importorskip("fastapi")
    from loraplex_engine.server.tinker.routes import CLIENT_CONFIG as ENGINE

    # And futures polled one by one: a session's engine may change under the gateway's
    # client experiments, which a per-session poller would not follow (tinker_batch.py).
    uncompressed = {**ENGINE, "proto_compress_fwdbwd": False}
    assert {**uncompressed, "sample_use_retrieve_futures": False} == CLIENT_CONFIG


def test_an_engine_serves_its_base_model_by_name_whatever_the_tag() -> None:
    e = Engine("e", "p", "http://e", "t", base_model="tiny-llama")
    assert e.serves("tiny-llama") and e.serves("tiny-llama:latest") and e.serves(None)
    assert not e.serves("Qwen/Qwen3-8B") and not e.serves("tiny")
    assert Engine("e", "p", "http://e", "t").serves("anything")  # unknown: the engine checks
