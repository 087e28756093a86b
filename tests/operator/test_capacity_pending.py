"""Engine pods without a node yet (pure): held behind a scheduling gate (Kueue's pod
integration gates every Pod labelled with a queue until its quota admits it) or
unschedulable. Such a pod is capacity asked for, not there: nothing binds to it, it
counts toward the replicas already requested (no second scale-up), experiments wait
Pending saying why, the pool says so too, and one that holds nobody's room is removed
like an idle engine. When Kueue preempts an engine it deletes the Pod: the experiments
on it recover from their checkpoints as after any pod loss."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from loraplex_operator import status as st
from loraplex_operator.observation import (
    WAIT_ADMISSION,
    WAIT_ENGINE_UNSCHEDULABLE,
    EngineView,
    pool_observation,
)
from loraplex_operator.planning import plan_round
from loraplex_operator.publish import derive

from tests.support.builders import pool
from tests.support.reconcile_inputs import CFG, NOW, engine, exp, snap

KUEUE_GATE = {"name": "kueue.x-k8s.io/admission"}
NOW_DT = datetime.fromtimestamp(NOW, UTC)


def pod(name: str, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": spec, "status": {"phase": "Pending"}}


def gated(name: str) -> EngineView:
    return EngineView.from_pod(pod(name, schedulingGates=[KUEUE_GATE]))


def unschedulable(name: str) -> EngineView:
    p = pod(name)
    p["status"]["conditions"] = [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    ]
    return EngineView.from_pod(p)


def test_a_gated_pod_is_capacity_pending_for_admission() -> None:
    view = gated("p-engine-a")
    assert view.gated and not view.usable
    assert view.capacity_pending == WAIT_ADMISSION


def test_an_unschedulable_pod_is_capacity_pending_for_a_node() -> None:
    view = unschedulable("p-engine-a")
    assert view.unschedulable and view.capacity_pending == WAIT_ENGINE_UNSCHEDULABLE


@pytest.mark.parametrize(
    "p",
    [
        pod("p-engine-a", nodeName="n1"),  # scheduled, starting
        pod("p-engine-a", schedulingGates=[]),  # gate lifted
        {  # waiting for its node to say more: not unschedulable
            **pod("p-engine-a"),
            "status": {"conditions": [{"type": "PodScheduled", "status": "False"}]},
        },
        {  # deleted while gated (Kueue preempting): gone soon, no longer capacity asked for
            **pod("p-engine-a", schedulingGates=[KUEUE_GATE]),
            "metadata": {"name": "p-engine-a", "deletionTimestamp": "2026-12-04T00:00:00Z"},
        },
    ],
)
def test_other_pods_are_not_capacity_pending(p: dict[str, Any]) -> None:
    assert EngineView.from_pod(p).capacity_pending is None


def _reasons(plan: Any) -> set[str | None]:
    return {w.waiting_reason for w in plan.work.values()}


def test_experiments_wait_pending_for_admission_without_binding_or_scaling() -> None:
    exps = [exp(f"x{i}", created=i) for i in range(3)]
    plan = plan_round(snap(exps, [gated("e1")]), CFG)
    assert not plan.puts and plan.create_pods == 0 and not plan.delete_pods
    assert _reasons(plan) == {WAIT_ADMISSION}
    status = derive(plan.work["team-a/x0"], CFG, NOW_DT)
    assert status.phase == "Pending"
    conditions = status.to_json()["conditions"]  # as written: what kstatus reads
    scheduled = st.get_condition(conditions, "Scheduled")
    assert scheduled is not None and scheduled["reason"] == WAIT_ADMISSION
    assert st.is_true(conditions, "Reconciling")
    assert not st.is_true(conditions, "Stalled")


def test_no_scale_up_storm_round_after_round() -> None:
    """A gated pod counts toward the replicas asked for: rounds that see it again ask for
    nothing more, however long Kueue takes."""
    p = pool().slots(4).replicas(0, 3).obj()
    exps = [exp(f"x{i}", created=i) for i in range(4)]
    for _ in range(5):
        plan = plan_round(snap(exps, [gated("e1")], p), CFG)
        assert plan.create_pods == 0 and _reasons(plan) == {WAIT_ADMISSION}


def test_only_what_a_gated_pod_cannot_hold_scales_up() -> None:
    p = pool().slots(4).replicas(0, 3).obj()
    exps = [exp(f"x{i}", created=i) for i in range(5)]  # 4 fit the gated engine, 1 does not
    first = plan_round(snap(exps, [gated("e1")], p), CFG)
    assert first.create_pods == 1
    assert sorted(w.waiting_reason or "" for w in first.work.values()) == [
        *[WAIT_ADMISSION] * 4,
        "WaitingForEngine",  # the fifth, on the engine being created
    ]
    second = plan_round(snap(exps, [gated("e1"), gated("e2")], p), CFG)
    assert second.create_pods == 0 and _reasons(second) == {WAIT_ADMISSION}


def test_unschedulable_engine_says_so_on_the_experiment() -> None:
    plan = plan_round(snap([exp("a")], [unschedulable("e1")]), CFG)
    assert not plan.puts and plan.create_pods == 0
    assert _reasons(plan) == {WAIT_ENGINE_UNSCHEDULABLE}


def test_bound_once_the_gate_lifts() -> None:
    exps = [exp(f"x{i}", created=i) for i in range(2)]
    plan = plan_round(snap(exps, [engine("e1")]), CFG)  # admitted, started, ready
    assert {p.engine for p in plan.puts} == {"e1"} and len(plan.puts) == 2


def test_a_gated_pod_that_holds_nobody_is_removed_like_an_idle_engine() -> None:
    p = pool().slots(4).replicas(0, 2).obj()
    first = plan_round(snap([], [gated("e1")], p), CFG)
    assert first.delete_pods == [] and set(first.idle_since) == {"e1"}
    later = plan_round(snap([], [gated("e1")], p, idle_since={"e1": NOW - 60}), CFG)
    assert later.delete_pods == ["e1"]
    holding = plan_round(snap([exp("a")], [gated("e1")], p, idle_since={"e1": NOW - 60}), CFG)
    assert holding.delete_pods == []  # someone waits for its room
    kept = pool().slots(4).replicas(1, 2).obj()
    at_min = plan_round(snap([], [gated("e1")], kept, idle_since={"e1": NOW - 60}), CFG)
    assert at_min.delete_pods == [] and at_min.create_pods == 0


def test_an_engine_kueue_evicted_is_recovered_from_its_checkpoint() -> None:
    """Kueue preempts by deleting the Pod: the engine checkpoints on SIGTERM, and once the
    Pod is gone its experiment resumes elsewhere; the replacement pod waits for admission."""
    ckpt = {"path": "/ckpt/team-a/a/uid/step-00000004", "step": 4}
    running = exp("a", phase="Running", engine="e1", checkpoint=ckpt)
    draining = engine("e1", "team-a.a")
    draining.deleting_until = NOW + 30
    draining.reachable = False
    waiting = plan_round(snap([running], [draining]), CFG)
    assert waiting.work["team-a/a"].restarts == 0 and not waiting.puts  # awaits its checkpoint
    after = plan_round(snap([running], []), CFG)
    w = after.work["team-a/a"]
    assert w.restarts == 1 and w.resume_from == ckpt["path"] and after.create_pods == 1
    assert [e[1] for e in w.events] == ["EngineLost"]
    regated = plan_round(snap([running], [gated("e2")]), CFG)
    w = regated.work["team-a/a"]
    assert not regated.puts and regated.create_pods == 0 and w.waiting_reason == WAIT_ADMISSION


def test_pool_observation_names_the_pods_without_a_node() -> None:
    engines = [engine("e1"), gated("e2"), unschedulable("e3"), gated("e0")]
    counts = pool_observation(snap([], engines, token_found=False))
    assert (counts.engines, counts.ready) == (4, 1)
    assert list(counts.gated) == ["e0", "e2"] and list(counts.unschedulable) == ["e3"]
    assert counts.token_found is False
    by_type = {c.type: c for c in st.pool_status(counts, 1, None, NOW_DT).conditions or ()}
    assert by_type["Stalled"].status == "True"  # the missing Secret needs a human first
    counts = pool_observation(snap([], engines))
    by_type = {c.type: c for c in st.pool_status(counts, 1, None, NOW_DT).conditions or ()}
    assert by_type["CapacityPending"].reason == "WaitingForAdmission"
    assert by_type["Reconciling"].status == "True"
