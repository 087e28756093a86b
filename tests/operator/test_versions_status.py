"""The operator's side of published versions (loraplex_operator/versions.py), pure: when a
spec.publish edit is pushed, the status fields and condition from the engine's report,
and what each alias move is."""

from __future__ import annotations

from loraplex_engine.spec.experiment import parse_spec
from loraplex_engine.spec.publish import TOKEN_PATTERN as ENGINE_TOKEN_PATTERN
from loraplex_operator.api.status import (
    ALIASES_MAX,
    TOKEN_PATTERN,
    ExperimentStatus,
    VersionStatus,
)
from loraplex_operator.versions import (
    Move,
    moves,
    new_gate_failures,
    publish_differs,
    published_condition,
    stable_number,
    status_fields,
)

from tests.support.builders import experiment
from tests.support.crdkit import apply_defaults, schema_of

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


FAILED = {
    "version": "v2",
    "step": 6,
    "scores": {"meanReward": 0.25, "evalReward": 0.41},
    "evalStep": 6,
    "gatePassed": False,
    "gateNote": "evalReward 0.41 < promoteWhen.atLeast 0.8",
    "requestToken": "release-7",
    "createdAt": "2026-12-06T11:00:00.123456+00:00",
    "contentHash": "ab" * 32,
}


def test_status_fields_carry_the_gate_the_eval_and_the_request() -> None:
    fields = status_fields({"versions": [FAILED], "publishRequestToken": "release-7"})
    (v,) = fields["versions"]
    assert (v.eval_step, v.gate_passed, v.request_token) == (6, False, "release-7")
    assert v.gate_note == FAILED["gateNote"]
    assert v.scores == {"evalReward": 0.41, "meanReward": 0.25}
    assert fields["publish_request_token"] == "release-7"
    # The status as written: camelCase fields, and the schema's bounds hold for it.
    status = ExperimentStatus(**fields).to_json()
    assert status["publishRequestToken"] == "release-7"
    assert status["versions"][0]["gateNote"] == FAILED["gateNote"]
    assert "contentHash" not in status["versions"][0]  # not a status field
    # No token published yet (null), or none reported: the field is not set (the old stays).
    assert "publish_request_token" not in status_fields({"publishRequestToken": None})


def test_a_hostile_engine_report_is_cut_to_the_schema() -> None:
    """The engine is trusted less than the API server: what would break the status patch
    (a too long note, a token outside the label alphabet, odd kinds, too many entries) is
    cut or dropped, field by field, and the version itself kept."""
    hostile = {
        **FAILED,
        "gateNote": "x" * 100_000,
        "requestToken": "../../etc;rm -rf",
        "evalStep": -3,
        "step": "six",
        "gatePassed": "no",
        "scores": {
            "evalReward": float("nan"),
            "a b": 1.0,
            "ok": True,
            "meanReward": 0.5,
            **{f"s{i}": 1.0 for i in range(20)},
        },
        "createdAt": "yesterday",
    }
    fields = status_fields({"versions": [hostile] * 12, "publishRequestToken": "x" * 64})
    assert len(fields["versions"]) == 10  # the schema's maxItems: the newest ten
    v = fields["versions"][0]
    assert v.gate_note == "x" * 256
    assert (v.request_token, v.eval_step, v.step, v.gate_passed, v.created_at) == (None,) * 5
    assert v.scores is not None and len(v.scores) == 8 and v.scores["meanReward"] == 0.5
    assert not {"evalReward", "a b", "ok"} & set(v.scores)
    assert "publish_request_token" not in fields
    ExperimentStatus(**fields)  # valid against the model (and so the generated schema)


def test_hostile_aliases_are_cut_to_the_schema() -> None:
    """Aliases that do not read as an alias and a version are dropped; of too many, latest
    and stable are kept first (the status schema's maxProperties, else the patch fails)."""
    aliases = {f"canary-{i:02d}": "v1" for i in range(60)}
    aliases |= {"stable": "v2", "latest": "v3", "Bad Name": "v1", "x" * 40: "v1"}
    aliases |= {"rollback": "../v1", "shadow": 7}
    fields = status_fields({"aliases": aliases})
    kept = fields["aliases"]
    assert len(kept) == ALIASES_MAX
    assert kept["stable"] == "v2" and kept["latest"] == "v3"
    assert not {"Bad Name", "x" * 40, "rollback", "shadow"} & set(kept)
    ExperimentStatus(**fields)  # valid against the model (and so the generated schema)


def test_the_token_pattern_is_the_engines() -> None:
    assert TOKEN_PATTERN == ENGINE_TOKEN_PATTERN


def test_a_failed_gate_is_news_once() -> None:
    failed = status_fields({"versions": [FAILED]})["versions"]
    assert [v.version for v in new_gate_failures(None, failed)] == ["v2"]
    assert new_gate_failures([FAILED], failed) == []  # already in the status written last
    assert new_gate_failures([], failed, evented=2) == []  # already told (a stale read)
    passed = VersionStatus(version="v3", gate_passed=True)
    ungated = VersionStatus(version="v4")
    assert new_gate_failures(None, [*failed, passed, ungated], evented=1) == list(failed)


def test_the_published_condition() -> None:
    spec = {"publish": PUBLISH}
    assert published_condition({}, {"latest": "v1"}, None) is None  # no publish block
    ok = published_condition(spec, {"stable": "v2", "latest": "v3"}, None)
    assert ok is not None and ok["status"] == "True" and ok["message"] == "latest v3, stable v2"
    bad = published_condition(spec, {"latest": "v3"}, "publish.aliases stable: v3 failed its gate")
    assert bad is not None and (bad["status"], bad["reason"]) == ("False", "PublishFailed")
    none = published_condition(spec, None, None)
    assert none is not None and none["reason"] == "NoVersionYet"
    # The newest version failed its gate: the message names it and why; a newer one that
    # passes takes the note away.
    failed = status_fields({"versions": [FAILED]})["versions"]
    gate = published_condition(spec, {"latest": "v2", "stable": "v1"}, None, failed)
    assert gate is not None and (gate["status"], gate["reason"]) == ("True", "Published")
    assert gate["message"] == (
        "latest v2, stable v1; v2 failed its gate: evalReward 0.41 < promoteWhen.atLeast 0.8"
    )
    later = [*failed, VersionStatus(version="v3", gate_passed=True)]
    ok = published_condition(spec, {"latest": "v3", "stable": "v3"}, None, later)
    assert ok is not None and ok["message"] == "latest v3, stable v3"


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
