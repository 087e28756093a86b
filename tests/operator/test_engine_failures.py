"""Engine pod failures explained (pure): each container or pod state a kubelet or the
scheduler writes becomes one reason with the container's last message; the pool is
Stalled with that reason, experiments waiting for the engine say why in `Scheduled`,
and failed pods are replaced with an exponential back-off (`backoffs.RecreateBackoff`).
The same states produced by the test kubelet: tests/operator/test_engine_failures_e2e.py."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from loraplex_operator import status as st
from loraplex_operator.backoffs import RecreateBackoff, recreate_delay
from loraplex_operator.engine_failures import PodFailure, pod_failure
from loraplex_operator.observation import EngineView, pool_observation
from loraplex_operator.planning import plan_round
from loraplex_operator.resources import Experiment

from tests.support.crdkit import schema_errors, schema_of
from tests.support.reconcile_inputs import CFG, NOW, engine, exp, snap, timestamp

NOW_DT = datetime.fromtimestamp(NOW, UTC)
KEY = Experiment.from_obj(exp("a")).key
LOG = "FileNotFoundError: /models/missing/config.json"


def pod(
    phase: str = "Running",
    state: dict[str, Any] | None = None,
    last: dict[str, Any] | None = None,
    ready: bool = False,
    started: bool | None = None,
    conditions: list[dict[str, Any]] | None = None,
    **status: Any,
) -> dict[str, Any]:
    cs: dict[str, Any] = {"name": "engine", "ready": ready, "restartCount": 3}
    if state is not None:
        cs["state"] = state
    if last is not None:
        cs["lastState"] = {"terminated": last}
    if started is not None:
        cs["started"] = started
    return {
        "metadata": {"name": "p-engine-abcde", "namespace": "loraplex-system"},
        "spec": {"nodeName": "node-1"},
        "status": {
            "phase": phase,
            "containerStatuses": [cs],
            "conditions": conditions or [],
            **status,
        },
    }


CRASH = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting"}}
CASES = {
    "CrashLoopBackOff": (
        pod(state=CRASH, last={"exitCode": 1, "reason": "Error", "message": LOG}),
        f"back-off 40s restarting; last exit: exit code 1 (Error): {LOG}",
    ),
    "OOMKilled": (
        pod(state=CRASH, last={"exitCode": 137, "reason": "OOMKilled"}),
        "back-off 40s restarting; last exit: exit code 137 (OOMKilled)",
    ),
    "ImagePullBackOff": (
        pod(
            "Pending",
            {"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "x"'}},
        ),
        'Back-off pulling image "x"',
    ),
    "ErrImagePull": (
        pod("Pending", {"waiting": {"reason": "ErrImagePull", "message": "not found"}}),
        "not found",
    ),
    "CreateContainerConfigError": (
        pod(
            "Pending",
            {
                "waiting": {
                    "reason": "CreateContainerConfigError",
                    "message": 'secret "hf" not found',
                }
            },
        ),
        'secret "hf" not found',
    ),
    "ReadinessProbeFailing": (
        pod(
            state={"running": {"startedAt": timestamp(NOW - 900)}},
            started=True,
            conditions=[
                {
                    "type": "Ready",
                    "status": "False",
                    "lastTransitionTime": timestamp(NOW - 700),
                    "message": "containers with unready status: [engine]",
                }
            ],
        ),
        "running but not ready for 700 s (readiness probe failing); "
        "containers with unready status: [engine]",
    ),
    "Unschedulable": (
        pod(
            "Pending",
            conditions=[
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "lastTransitionTime": timestamp(NOW - 601),
                    "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                }
            ],
        ),
        "unschedulable for 601 s: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
    ),
    "UnexpectedAdmissionError": (
        pod("Failed", reason="UnexpectedAdmissionError", message="no healthy devices"),
        "no healthy devices",
    ),
}


@pytest.mark.parametrize("reason", sorted(CASES))
def test_each_failure_is_one_reason_with_the_containers_message(reason: str) -> None:
    obj, message = CASES[reason]
    failure = pod_failure(obj, NOW, stall_after=600)
    assert failure is not None and failure.reason == reason
    assert failure.message == message
    assert failure.pod == "p-engine-abcde"


def test_what_waiting_fixes_is_no_failure() -> None:
    starting = pod(state={"waiting": {"reason": "ContainerCreating"}})
    loading = pod(state={"running": {"startedAt": timestamp(NOW - 900)}}, started=False)
    recent = CASES["ReadinessProbeFailing"][0]
    ready = pod(state={"running": {"startedAt": timestamp(NOW - 900)}}, ready=True, started=True)
    ready["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    for obj in (starting, loading, ready):
        assert pod_failure(obj, NOW, stall_after=600) is None
    assert pod_failure(recent, NOW, stall_after=701) is None  # not long enough yet
    deleting = CASES["CrashLoopBackOff"][0] | {
        "metadata": {"name": "x", "deletionTimestamp": timestamp(NOW)}
    }
    assert pod_failure(deleting, NOW) is None


def test_a_long_message_is_cut() -> None:
    obj = pod(state=CRASH, last={"exitCode": 1, "message": "x" * 5000})
    failure = pod_failure(obj, NOW)
    assert failure is not None and len(failure.message) == 1024


def failing(name: str, reason: str = "CrashLoopBackOff", message: str = LOG) -> EngineView:
    view = engine(name, ready=False)
    view.failure = PodFailure(name, reason, message, "engine")
    return view


def pool_conditions(engines: list[EngineView], **kw: Any) -> dict[str, dict[str, Any]]:
    obs = pool_observation(snap([], engines, **kw))
    status = st.pool_status(obs, 1, None, NOW_DT).to_json()
    assert schema_errors(schema_of("EnginePool")["properties"]["status"], status) == []
    return {c["type"]: c for c in status["conditions"]}


def test_a_failing_engine_pod_stalls_the_pool_naming_pod_container_and_message() -> None:
    conds = pool_conditions([engine("e0"), failing("e1"), failing("e2", "ImagePullBackOff", "")])
    stalled = conds["Stalled"]
    assert (stalled["status"], stalled["reason"]) == ("True", "CrashLoopBackOff")
    assert stalled["message"] == (
        f"1/3 engines ready; engine pod e1 container engine: CrashLoopBackOff: {LOG}; "
        "engine pod e2 container engine: ImagePullBackOff"
    )
    assert conds["Ready"]["status"] == "False" and conds["Reconciling"]["status"] == "False"


def test_a_held_back_replacement_keeps_the_pool_stalled_until_an_engine_is_ready() -> None:
    held = PodFailure("gone", "UnexpectedAdmissionError", "no healthy devices")
    stalled = pool_conditions([], recreate_held=held)["Stalled"]
    assert (stalled["status"], stalled["reason"]) == ("True", "UnexpectedAdmissionError")
    assert pool_conditions([])["Stalled"]["status"] == "False"


def test_experiments_waiting_for_a_failing_engine_say_why_in_scheduled() -> None:
    plan = plan_round(snap([exp("a")], [failing("e0")]), CFG)
    w = plan.work[KEY]
    assert w.waiting_reason == "CrashLoopBackOff" and plan.create_pods == 0
    status = st.derive_status(
        w.exp,
        st.Observation(waiting_reason=w.waiting_reason, waiting_message=w.waiting_message),
        NOW_DT,
    )
    scheduled = status.condition(st.COND_SCHEDULED)
    assert scheduled is not None and scheduled.reason == "CrashLoopBackOff"
    assert f"engine pod e0 container engine: CrashLoopBackOff: {LOG}" in scheduled.message
    assert status.condition(st.STALLED).status == "True"  # fixing the pool needs a human
    assert st.phase_reason(status) == "CrashLoopBackOff"


def test_an_unschedulable_engine_keeps_the_experiments_reason_engine_unschedulable() -> None:
    view = failing("e0", "Unschedulable", "0/3 nodes")
    view.unschedulable, view.node = True, None
    w = plan_round(snap([exp("a")], [view]), CFG).work[KEY]
    assert w.waiting_reason == "EngineUnschedulable"


def test_no_new_pod_while_the_replacement_is_held_back() -> None:
    held = PodFailure("gone", "UnexpectedAdmissionError", "no healthy devices")
    free = plan_round(snap([exp("a")], []), CFG)
    assert free.create_pods == 1
    plan = plan_round(snap([exp("a")], [], recreate_held=held), CFG)
    assert plan.create_pods == 0
    w = plan.work[KEY]
    assert w.waiting_reason == "UnexpectedAdmissionError"
    assert w.waiting_message == "no new engine yet: engine pod gone: " + (
        "UnexpectedAdmissionError: no healthy devices"
    )


def test_recreate_delays_grow_like_the_kubelets_crash_backoff() -> None:
    assert [recreate_delay(n) for n in range(1, 8)] == [0, 10, 20, 40, 80, 160, 300]


def test_recreate_backoff_counts_each_failed_pod_once_and_resets_on_a_new_ready_engine() -> None:
    b = RecreateBackoff()
    f = [PodFailure(f"p{i}", "Evicted", "") for i in range(4)]
    up = ["serving"]  # an engine that stays ready throughout: it resets nothing
    b.observe([f[0]], up, NOW)
    assert b.holding(NOW) is None  # the first replacement at once
    b.observe([f[0]], up, NOW + 1)  # the same dead pod, still listed: not counted again
    b.observe([f[1]], up, NOW + 2)
    assert b.failures == 2 and b.holding(NOW + 11) == f[1] and b.holding(NOW + 12) is None
    b.observe([f[2]], up, NOW + 13)
    assert b.failures == 3 and b.holding(NOW + 32) == f[2]
    b.observe([], [*up, "p4"], NOW + 34)  # a new engine came up
    assert b.failures == 0 and b.holding(NOW + 34) is None
