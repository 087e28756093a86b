"""The spec's publish block (spec/publish.py), as the engine parses it."""

from __future__ import annotations

import pytest
from loraplex_engine.spec.errors import SpecError
from loraplex_engine.spec.experiment import parse_spec
from loraplex_engine.spec.publish import hand_aliases, pinned_versions

BASE = {"task": {"name": "target-token"}}


def _publish(**publish: object) -> dict[str, object]:
    return {**BASE, "publish": publish}


def test_absent_means_nothing_published() -> None:
    spec = parse_spec(BASE)
    assert spec.publish is None
    assert hand_aliases(spec.publish) == {} and pinned_versions(spec.publish) == set()


def test_a_full_block() -> None:
    spec = parse_spec(
        _publish(
            everySteps=5,
            keep=2,
            pinned=["v3"],
            aliases=[{"name": "stable", "version": "v2"}, {"name": "canary", "version": "v4"}],
            promoteWhen={"atLeast": 0.5},
        )
    )
    assert spec.publish is not None and spec.publish.promote_when is not None
    assert spec.publish.promote_when.score == "meanReward"
    assert hand_aliases(spec.publish) == {"stable": 2, "canary": 4}
    assert pinned_versions(spec.publish) == {3}
    assert parse_spec(spec.to_json()) == spec  # round trip through the wire form


@pytest.mark.parametrize(
    ("publish", "field"),
    [
        ({"aliases": [{"name": "latest", "version": "v1"}]}, "spec.publish.aliases.0.name"),
        (
            {"aliases": [{"name": "a", "version": "v1"}, {"name": "a", "version": "v2"}]},
            "spec.publish.aliases",
        ),
        ({"aliases": [{"name": "../x", "version": "v1"}]}, "spec.publish.aliases.0.name"),
        ({"aliases": [{"name": "a", "version": "1"}]}, "spec.publish.aliases.0.version"),
        ({"pinned": ["v1", "v1"]}, "spec.publish.pinned"),
        ({"everySteps": 0}, "spec.publish.everySteps"),
        ({"promoteWhen": {"score": "meanReward"}}, "spec.publish.promoteWhen.atLeast"),
        ({"unknown": 1}, "spec.publish.unknown"),
    ],
)
def test_bad_blocks_name_the_field(publish: dict[str, object], field: str) -> None:
    with pytest.raises(SpecError) as e:
        parse_spec(_publish(**publish))
    assert e.value.field == field, e.value
