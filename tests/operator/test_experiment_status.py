"""LoRAExperiment status derivation: phases, conditions, preserved transition times."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from builders import experiment
from crdkit import schema_errors, schema_of
from loraplex_operator import status as st
from loraplex_operator.resources import Experiment
from loraplex_operator.status import (
    Binding,
    Observation,
    get_condition,
    is_true,
    merge_conditions,
    phase_reason,
    pool_status,
)


def derive_status(obj: dict[str, Any], obs: Observation, now: datetime) -> dict[str, Any]:
    """The status derived for a raw object, through the view the operator builds of it."""
    return st.derive_status(Experiment.from_obj(obj), obs, now)


T0 = datetime(2026, 12, 2, 15, 0, 0, tzinfo=UTC)
T1 = T0 + timedelta(minutes=5)

RUNNING_ENGINE = {
    "id": "team-a.a",
    "namespace": "team-a",
    "name": "a",
    "phase": "Running",
    "step": 12,
    "maxSteps": 50,
    "reward": 0.62,
    "rolloutTokens": 4096,
    "trainTokens": 5120,
    "checkpoint": {"path": "/ckpt/team-a/a/step-00000010", "step": 10},
    "adapterPath": "/ckpt/team-a/a/step-00000010",
    "error": None,
    "startedAt": "2026-12-02T15:00:00Z",
    "updatedAt": "2026-12-02T15:01:00Z",
}
BOUND = Binding(engine="pool-a-engine-x1", node="node-1")


def _true_conditions(status: dict[str, Any]) -> set[str]:
    return {c["type"] for c in status["conditions"] if c["status"] == "True"}


@pytest.mark.parametrize(
    ("name", "obj", "obs", "phase", "true_conditions"),
    [
        ("pending", experiment("a").obj(), Observation(), "Pending", {"Admitted"}),
        (
            "bound, engine not reporting yet",
            experiment("a").obj(),
            Observation(binding=BOUND),
            "Scheduled",
            {"Admitted", "Scheduled"},
        ),
        (
            "running",
            experiment("a").obj(),
            Observation(binding=BOUND, engine_status=RUNNING_ENGINE),
            "Running",
            {"Admitted", "Scheduled", "Running"},
        ),
        (
            "suspended",
            experiment("a").suspend().obj(),
            Observation(),
            "Suspended",
            {"Admitted", "Suspended"},
        ),
        (
            "succeeded",
            experiment("a").obj(),
            Observation(
                binding=BOUND, engine_status={**RUNNING_ENGINE, "phase": "Succeeded", "step": 50}
            ),
            "Succeeded",
            {"Admitted", "Scheduled", "Succeeded"},
        ),
        (
            "engine failure",
            experiment("a").obj(),
            Observation(
                binding=BOUND,
                engine_status={**RUNNING_ENGINE, "phase": "Failed", "error": "NaN loss"},
            ),
            "Failed",
            {"Admitted", "Scheduled", "Failed"},
        ),
        (
            "restart budget",
            experiment("a").obj(),
            Observation(restarts=4, max_restarts=3),
            "Failed",
            {"Admitted", "Failed"},
        ),
        (
            "admission problem",
            experiment("a").obj(),
            Observation(
                problems=["spec.lora.rank: rank 128 exceeds EnginePool 'pool-a' max rank 64"]
            ),
            "Pending",
            set(),
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_phase_and_conditions(
    name: str, obj: dict, obs: Observation, phase: str, true_conditions: set[str]
) -> None:
    status = derive_status(obj, obs, T0)
    assert status["phase"] == phase
    assert _true_conditions(status) == true_conditions


@pytest.mark.parametrize(
    ("obj", "obs", "phase", "reason"),
    [
        (experiment("a").obj(), Observation(), "Pending", "WaitingForPlacement"),
        (experiment("a").obj(), Observation(waiting_reason="NoCapacity"), "Pending", "NoCapacity"),
        (experiment("a").obj(), Observation(problems=["spec.x: no"]), "Pending", "AdmissionFailed"),
        (experiment("a").obj(), Observation(binding=BOUND), "Scheduled", "Bound"),
        (
            experiment("a").obj(),
            Observation(binding=BOUND, engine_status=RUNNING_ENGINE),
            "Running",
            "Training",
        ),
        (experiment("a").suspend().obj(), Observation(), "Suspended", "SuspendRequested"),
        (
            experiment("a").obj(),
            Observation(binding=BOUND, engine_status={**RUNNING_ENGINE, "phase": "Succeeded"}),
            "Succeeded",
            "MaxStepsReached",
        ),
        (
            experiment("a").obj(),
            Observation(binding=BOUND, engine_status={**RUNNING_ENGINE, "phase": "Failed"}),
            "Failed",
            "EngineReportedFailure",
        ),
        (experiment("a").obj(), Observation(restarts=4), "Failed", "RestartBudgetExhausted"),
    ],
)
def test_phase_reason_is_the_reason_of_the_phase(
    obj: dict, obs: Observation, phase: str, reason: str
) -> None:
    status = derive_status(obj, obs, T0)
    assert (status["phase"], phase_reason(status)) == (phase, reason)
    # Terminal phases are sticky, and so is their reason.
    obj["status"] = status
    again = derive_status(obj, Observation(binding=BOUND, engine_status=RUNNING_ENGINE), T1)
    if phase in ("Succeeded", "Failed"):
        assert (again["phase"], phase_reason(again)) == (phase, reason)


@pytest.mark.parametrize(
    "status",
    [
        {},
        {"phase": "Failed"},  # no conditions
        {"phase": "Failed", "conditions": [{"type": "Failed", "reason": "not a label value"}]},
        {"phase": "Failed", "conditions": [{"type": "Failed", "reason": "X" * 65}]},
    ],
)
def test_phase_reason_is_bounded(status: dict[str, Any]) -> None:
    assert phase_reason(status) == "Unknown"


def test_running_copies_engine_progress() -> None:
    status = derive_status(
        experiment("a").obj(), Observation(binding=BOUND, engine_status=RUNNING_ENGINE), T0
    )
    assert (status["step"], status["reward"]) == (12, 0.62)
    assert status["checkpoint"] == {"path": "/ckpt/team-a/a/step-00000010", "step": 10}
    assert (status["engine"], status["node"]) == ("pool-a-engine-x1", "node-1")
    assert status["startedAt"] == "2026-12-02T15:00:00Z"


def test_failure_message_carries_engine_error() -> None:
    obs = Observation(
        binding=BOUND, engine_status={**RUNNING_ENGINE, "phase": "Failed", "error": "NaN loss"}
    )
    status = derive_status(experiment("a").obj(), obs, T0)
    assert status["message"] == "NaN loss"
    assert get_condition(status["conditions"], "Failed")["reason"] == "EngineReportedFailure"
    assert status["completedAt"] == "2026-12-02T15:00:00Z"


def test_pending_reason_comes_from_placement() -> None:
    status = derive_status(experiment("a").obj(), Observation(waiting_reason="NoCapacity"), T0)
    assert get_condition(status["conditions"], "Scheduled")["reason"] == "NoCapacity"
    assert (status["engine"], status["node"]) == (
        None,
        None,
    )  # merge-patch nulls clear a stale binding


def test_admission_problem_is_on_the_admitted_condition() -> None:
    problem = "spec.lora.rank: rank 128 exceeds EnginePool 'pool-a' max rank 64"
    status = derive_status(experiment("a").obj(), Observation(problems=[problem]), T0)
    cond = get_condition(status["conditions"], "Admitted")
    assert (cond["status"], cond["reason"], cond["message"]) == (
        "False",
        "AdmissionFailed",
        problem,
    )


def test_transition_time_kept_while_status_unchanged() -> None:
    obj = experiment("a").obj()
    first = derive_status(obj, Observation(binding=BOUND, engine_status=RUNNING_ENGINE), T0)
    obj["status"] = first
    later = derive_status(
        obj, Observation(binding=BOUND, engine_status={**RUNNING_ENGINE, "step": 20}), T1
    )
    assert (
        get_condition(later["conditions"], "Running")["lastTransitionTime"]
        == "2026-12-02T15:00:00Z"
    )
    assert later["step"] == 20


def test_transition_time_moves_when_status_flips() -> None:
    obj = experiment("a").obj()
    obj["status"] = derive_status(obj, Observation(binding=BOUND, engine_status=RUNNING_ENGINE), T0)
    obj["spec"]["suspend"] = True
    suspended = derive_status(obj, Observation(), T1)
    assert get_condition(suspended["conditions"], "Running")["status"] == "False"
    assert (
        get_condition(suspended["conditions"], "Running")["lastTransitionTime"]
        == "2026-12-02T15:05:00Z"
    )
    assert (
        get_condition(suspended["conditions"], "Admitted")["lastTransitionTime"]
        == "2026-12-02T15:00:00Z"
    )


def test_observed_generation_on_status_and_conditions() -> None:
    status = derive_status(experiment("a").generation(7).obj(), Observation(), T0)
    assert status["observedGeneration"] == 7
    assert {c["observedGeneration"] for c in status["conditions"]} == {7}


def test_suspend_keeps_last_checkpoint_for_resume() -> None:
    obj = experiment("a").obj()
    obj["status"] = derive_status(obj, Observation(binding=BOUND, engine_status=RUNNING_ENGINE), T0)
    obj["spec"]["suspend"] = True
    status = derive_status(obj, Observation(), T1)
    assert status["checkpoint"]["step"] == 10 and status["engine"] is None


@pytest.mark.parametrize("terminal", ["Succeeded", "Failed"])
def test_terminal_phases_are_sticky(terminal: str) -> None:
    obj = experiment("a").status(phase=terminal, step=50).obj()
    status = derive_status(obj, Observation(binding=BOUND, engine_status=RUNNING_ENGINE), T1)
    assert status["phase"] == terminal and status["step"] == 50


def test_restarts_recorded() -> None:
    status = derive_status(experiment("a").obj(), Observation(restarts=2), T0)
    assert status["restarts"] == 2 and status["phase"] == "Pending"


def test_status_validates_against_the_crd() -> None:
    obj = experiment("a").obj()
    status = derive_status(obj, Observation(binding=BOUND, engine_status=RUNNING_ENGINE), T0)
    obj["status"] = {k: v for k, v in status.items() if v is not None}
    status_schema = schema_of("LoRAExperiment")["properties"]["status"]
    assert schema_errors(status_schema, obj["status"]) == []


def test_merge_conditions_keeps_foreign_types() -> None:
    old = [
        {
            "type": "Custom",
            "status": "True",
            "reason": "X",
            "message": "",
            "lastTransitionTime": "t",
        }
    ]
    merged = merge_conditions(
        old, [{"type": "Ready", "status": "True", "reason": "R", "message": ""}], 1, T0
    )
    assert [c["type"] for c in merged] == ["Ready", "Custom"]
    assert is_true(merged, "Custom") and is_true(merged, "Ready")


def test_pool_status() -> None:
    status = pool_status(3, 2, 5, 7, generation=4, old_conditions=None, now=T0)
    assert (status["engines"], status["ready"], status["slotsUsed"], status["slotsFree"]) == (
        3,
        2,
        5,
        7,
    )
    assert is_true(status["conditions"], "Ready")
    status_schema = schema_of("EnginePool")["properties"]["status"]
    assert schema_errors(status_schema, status) == []
    assert not is_true(pool_status(1, 0, 0, 0, 4, status["conditions"], T1)["conditions"], "Ready")
