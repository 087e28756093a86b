"""The idle TTL of client experiments (idle.py, docs/design/gateway.md "unload_model and
the idle TTL"): the engine reports idleSeconds, the operator suspends with a mark, the
gateway's next call resumes; a tenant's own suspend is left alone."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from loraplex_engine.spec.client import IDLE_DEFAULT_S
from loraplex_operator import idle
from loraplex_operator import status as st
from loraplex_operator.gateway import experiments as gx
from loraplex_operator.planning import plan_round
from loraplex_operator.publish import derive
from loraplex_operator.round_plan import IDLE, SUSPEND

from tests.support.builders import experiment
from tests.support.reconcile_inputs import CFG, engine, snap

NOW = datetime(2026, 12, 6, 8, 0, tzinfo=UTC)


def test_the_default_ttl_is_the_engines() -> None:
    assert idle.IDLE_DEFAULT_S == IDLE_DEFAULT_S


@pytest.mark.parametrize(
    ("client", "reported", "due"),
    [
        ({}, 3600.0, 3600.0),  # the default TTL, reached
        ({}, 3599.9, None),
        ({"idleSeconds": 60}, 61, 61.0),
        ({"idleSeconds": 0}, 10**9, None),  # 0 = never
        ({"idleSeconds": 60}, None, None),  # an engine that does not report it
        ({"idleSeconds": 60}, True, None),
        (None, 10**9, None),  # a task experiment
    ],
)
def test_due(client: dict | None, reported: object, due: float | None) -> None:
    spec = (
        {"client": {"modelId": "s0123456789abcdef0123:train:0", **client}}
        if client is not None
        else {}
    )
    assert idle.due(spec, {"idleSeconds": reported}) == due


def test_suspend_and_resume_patches_mark_and_unmark() -> None:
    obj = experiment("a").client(idleSeconds=60).obj()
    suspended = idle.merged(obj, idle.suspend_patch(NOW))
    assert idle.idle_suspended(suspended) and suspended["spec"]["client"] == obj["spec"]["client"]
    resumed = idle.merged(suspended, idle.resume_patch())
    assert not idle.idle_suspended(resumed) and resumed["spec"]["suspend"] is False
    assert idle.IDLE_ANNOTATION not in (resumed["metadata"].get("annotations") or {})
    # Suspended by its tenant (no mark): not the idle TTL's.
    assert not idle.idle_suspended(experiment("a").client().suspend().obj())


def _running(**client: object) -> dict:
    return experiment("a").client(**client).status(phase="Running", engine="e1").obj()


def test_an_idle_client_experiment_is_unloaded_for_idleness_a_busy_one_is_not() -> None:
    idle_for = {"team_a_a": {"idleSeconds": 120.0}}
    plan = plan_round(snap([_running(idleSeconds=60)], [engine("e1", "team-a.a", **idle_for)]), CFG)
    assert [(u.reason, u.engine) for u in plan.unloads] == [(IDLE, "e1")]
    plan = plan_round(
        snap([_running(idleSeconds=600)], [engine("e1", "team-a.a", **idle_for)]), CFG
    )
    assert plan.unloads == []
    plan = plan_round(snap([_running(idleSeconds=0)], [engine("e1", "team-a.a", **idle_for)]), CFG)
    assert plan.unloads == []
    # Suspended already (by the TTL or its tenant): the suspend path unloads it.
    obj = idle.merged(_running(idleSeconds=60), idle.suspend_patch(NOW))
    plan = plan_round(snap([obj], [engine("e1", "team-a.a", **idle_for)]), CFG)
    assert [u.reason for u in plan.unloads] == [SUSPEND]


def test_an_idle_suspended_experiments_status_says_why_and_how_it_resumes() -> None:
    obj = idle.merged(_running(idleSeconds=60), idle.suspend_patch(NOW))
    obj["status"] = {"phase": "Suspended"}
    plan = plan_round(snap([obj], [engine("e1")]), CFG)
    status = derive(plan.work["team-a/a"], CFG, NOW)
    ready = next(c for c in status.conditions if c.type == "Ready")
    assert status.phase == st.SUSPENDED and ready.reason == "IdleTimeout"
    assert "next call" in status.message
    tenant = experiment("a").client().suspend().status(phase="Suspended").obj()
    status = derive(plan_round(snap([tenant], [engine("e1")]), CFG).work["team-a/a"], CFG, NOW)
    assert status.phase == st.SUSPENDED and "idle" not in status.message


def test_the_gateway_wakes_only_what_the_ttl_suspended() -> None:
    obj = idle.merged(_running(), idle.suspend_patch(NOW))
    obj["status"] = {"phase": "Suspended"}
    found = gx.binding(obj)
    assert found.state == "paused" and found.wake and "idle" in found.reason
    tenant = experiment("a").client().suspend().status(phase="Suspended").obj()
    found = gx.binding(tenant)
    assert found.state == "paused" and not found.wake
    assert not gx.binding(_running()).wake
