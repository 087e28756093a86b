"""The operator's side of published versions (loraplex_operator/versions.py), pure: when a
spec.publish edit is pushed, the status fields and condition from the engine's report,
and what each alias move is."""

from __future__ import annotations

from builders import experiment
from crdkit import apply_defaults, schema_of
from loraplex_engine.spec import parse_spec
from loraplex_operator.versions import (
    Move,
    moves,
    publish_differs,
    published_condition,
    stable_number,
    status_fields,
)

PUBLISH = {
    "everySteps": 3,
    "promoteWhen": {"atLeast": 0.5},
    "aliases": [{"name": "stable", "version": "v1"}],
}


def _defaulted(publish: dict | None) -> dict:
    obj = experiment("a").obj()
    if publish is not None:
        obj["spec"]["publish"] = publish
    return apply_defaults(schema_of("LoRAExperiment"), obj)["spec"]


def test_an_edit_is_pushed_and_the_same_block_is_not() -> None:
    raw = _defaulted(PUBLISH)
    applied = parse_spec(raw).publish
    assert applied is not None
    engine = {"publish": applied.to_json()}  # the engine's report: every field, lists empty
    assert not publish_differs(raw, engine)
    assert not publish_differs(_defaulted(None), {"publish": None})
    moved = _defaulted({**PUBLISH, "aliases": [{"name": "stable", "version": "v2"}]})
    assert publish_differs(moved, engine)
    assert publish_differs(_defaulted(None), engine)  # the block removed
    assert not publish_differs(raw, {})  # an engine that does not report one


def test_status_fields_keep_only_what_reads_as_a_version() -> None:
    engine = {
        "versions": [
            {"version": "v1", "step": 3, "scores": {"meanReward": 0.5}, "gatePassed": True},
            {"version": "../x", "step": 4},
            "junk",
        ],
        "aliases": {"stable": "v1", "latest": "v1"},
    }
    fields = status_fields(engine)
    assert [v.version for v in fields["versions"]] == ["v1"]
    assert fields["versions"][0].gate_passed is True
    assert fields["aliases"] == {"latest": "v1", "stable": "v1"}
    assert status_fields({"step": 3}) == {}  # no report: nothing (the old values carry)


def test_the_published_condition() -> None:
    spec = {"publish": PUBLISH}
    assert published_condition({}, {"latest": "v1"}, None) is None  # no publish block
    ok = published_condition(spec, {"stable": "v2", "latest": "v3"}, None)
    assert ok is not None and ok["status"] == "True" and ok["message"] == "latest v3, stable v2"
    bad = published_condition(spec, {"latest": "v3"}, "publish.aliases stable: v3 failed its gate")
    assert bad is not None and (bad["status"], bad["reason"]) == ("False", "PublishFailed")
    none = published_condition(spec, None, None)
    assert none is not None and none["reason"] == "NoVersionYet"


def test_each_move_is_named() -> None:
    found = moves({"latest": "v2", "stable": "v2", "canary": "v1"},
                  {"latest": "v3", "stable": "v1", "mine": "v3"})  # fmt: skip
    assert found == [
        Move("canary", "v1", None),
        Move("latest", "v2", "v3"),
        Move("mine", None, "v3"),
        Move("stable", "v2", "v1"),
    ]
    assert [m.kind for m in found] == ["alias", "publish", "alias", "rollback"]
    assert Move("stable", "v9", "v10").kind == "promotion"  # by number, not by text
    assert Move("stable", "v2", "v1").event() == ("Normal", "RolledBack", "alias stable: v2 -> v1")
    assert Move("stable", None, "v1").event()[1] == "Promoted"  # the gate's first
    assert Move("stable", "v1", None).event()[1] == "AliasMoved"
    assert stable_number({"stable": "v12"}) == 12 and stable_number({"latest": "v1"}) is None
