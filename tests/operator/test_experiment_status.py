"""LoRAExperiment status derivation: phases, conditions, preserved transition times.

`derive_status` returns the typed `ExperimentStatus`; tests read its fields, and its JSON
(`to_json`, as the API server stores it; `to_patch`, as the operator sends it) where that
is the point."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, get_args

import pytest
from loraplex_operator import status as st
from loraplex_operator.api.condition import Condition
from loraplex_operator.api.status import EnginePoolStatus, ExperimentPhase, ExperimentStatus
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

from tests.support.builders import experiment
from tests.support.crdkit import schema_errors, schema_of


def derive_status(obj: dict[str, Any], obs: Observation, now: datetime) -> ExperimentStatus:
    """The status derived for a raw object, through the view the operator builds of it."""
    return st.derive_status(Experiment.from_obj(obj), obs, now)


def _reason(status: ExperimentStatus | EnginePoolStatus, type_: str) -> str:
    cond = status.condition(type_)
    assert cond is not None, type_
    return cond.reason


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


def _true_conditions(status: ExperimentStatus) -> set[str]:
    return {c.type for c in status.conditions or () if c.status == "True"}


@pytest.mark.parametrize(
    ("name", "obj", "obs", "phase", "true_conditions"),
    [
        ("pending", experiment("a").obj(), Observation(), "Pending", {"Admitted", "Reconciling"}),
        (
            "bound, engine not reporting yet",
            experiment("a").obj(),
            Observation(binding=BOUND),
            "Scheduled",
            {"Admitted", "Scheduled", "Reconciling"},
        ),
        (
            "running",
            experiment("a").obj(),
            Observation(binding=BOUND, engine_status=RUNNING_ENGINE),
            "Running",
            {"Admitted", "Scheduled", "Running", "Ready"},
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
            {"Admitted", "Scheduled", "Succeeded", "Ready"},
        ),
        (
            "engine failure",
            experiment("a").obj(),
            Observation(
                binding=BOUND,
                engine_status={**RUNNING_ENGINE, "phase": "Failed", "error": "NaN loss"},
            ),
            "Failed",
            {"Admitted", "Scheduled", "Failed", "Stalled"},
        ),
        (
            "restart budget",
            experiment("a").obj(),
            Observation(restarts=4, max_restarts=3),
            "Failed",
            {"Admitted", "Failed", "Stalled"},
        ),
        (
            "admission problem",
            experiment("a").obj(),
            Observation(
                problems=["spec.lora.rank: rank 128 exceeds EnginePool 'pool-a' max rank 64"]
            ),
            "Pending",
            {"Stalled"},
        ),
        (
            "no engine of the pool could ever host it",
            experiment("a").obj(),
            Observation(waiting_reason="Unschedulable"),
            "Pending",
            {"Admitted", "Stalled"},
        ),
        (
            "waiting for Kueue to admit its engine",
            experiment("a").obj(),
            Observation(waiting_reason="WaitingForAdmission"),
            "Pending",
            {"Admitted", "Reconciling"},
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_phase_and_conditions(
    name: str, obj: dict, obs: Observation, phase: str, true_conditions: set[str]
) -> None:
    status = derive_status(obj, obs, T0)
    assert status.phase == phase
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
    assert (status.phase, phase_reason(status)) == (phase, reason)
    # Terminal phases are sticky, and so is their reason.
    obj["status"] = status.to_json()
    again = derive_status(obj, Observation(binding=BOUND, engine_status=RUNNING_ENGINE), T1)
    if phase in ("Succeeded", "Failed"):
        assert (again.phase, phase_reason(again)) == (phase, reason)


def _failed(reason: str) -> ExperimentStatus:
    # Unvalidated: the CRD refuses a reason with spaces, a status built in code need not.
    cond = Condition.model_construct(type="Failed", status="True", reason=reason)
    return ExperimentStatus.model_construct(phase="Failed", conditions=(cond,))


@pytest.mark.parametrize(
    "status",
    [
        ExperimentStatus(),
        ExperimentStatus(phase="Failed"),  # no conditions
        _failed("not a label value"),
        _failed("X" * 65),  # the CRD allows 1024 characters; a metric label gets 64
    ],
)
def test_phase_reason_is_bounded(status: ExperimentStatus) -> None:
    assert phase_reason(status) == "Unknown"


def test_running_copies_engine_progress() -> None:
    status = derive_status(
        experiment("a").obj(), Observation(binding=BOUND, engine_status=RUNNING_ENGINE), T0
    )
    assert (status.step, status.reward) == (12, 0.62)
    assert status.to_json()["checkpoint"] == {"path": "/ckpt/team-a/a/step-00000010", "step": 10}
    assert (status.engine, status.node) == ("pool-a-engine-x1", "node-1")
    assert status.started_at == "2026-12-02T15:00:00Z"


def test_running_copies_and_keeps_the_latest_eval() -> None:
    """spec.eval's latest result (docs/evaluation.md): copied from the engine, valid
    against the CRD, and kept while the engine does not report (the promotion gate's
    score must not vanish with an unreachable engine)."""
    obj = experiment("a").obj()
    evaluated = {**RUNNING_ENGINE, "evalStep": 10, "evalReward": 0.75, "evalPassAtK": 0.5}
    status = derive_status(obj, Observation(binding=BOUND, engine_status=evaluated), T0)
    assert (status.eval_step, status.eval_reward, status.eval_pass_at_k) == (10, 0.75, 0.5)
    body = status.to_json()
    assert (body["evalStep"], body["evalReward"], body["evalPassAtK"]) == (10, 0.75, 0.5)
    status_schema = schema_of("LoRAExperiment")["properties"]["status"]
    assert schema_errors(status_schema, body) == []
    again = derive_status({**obj, "status": body}, Observation(binding=BOUND), T1)
    assert (again.eval_step, again.eval_reward, again.eval_pass_at_k) == (10, 0.75, 0.5)
    # An engine without an eval result (none yet, or no spec.eval) reports none.
    plain = derive_status(obj, Observation(binding=BOUND, engine_status=RUNNING_ENGINE), T0)
    assert "evalReward" not in plain.to_json()


def _with_max_steps(obj: dict[str, Any], max_steps: int) -> dict[str, Any]:
    obj["spec"].setdefault("algorithm", {})["maxSteps"] = max_steps
    return obj


@pytest.mark.parametrize(
    ("max_steps", "engine_status", "want"),
    [
        (None, RUNNING_ENGINE, "12/50"),  # maxSteps' default
        (200, RUNNING_ENGINE, "12/200"),
        (0, RUNNING_ENGINE, "12/-"),  # continual
        (200, None, "0/200"),  # not placed yet
    ],
)
def test_progress_is_steps_of_max_steps(
    max_steps: int | None, engine_status: dict[str, Any] | None, want: str
) -> None:
    """`status.progress`, the printer column of `kubectl get lx`."""
    obj = experiment("a").obj()
    if max_steps is not None:
        _with_max_steps(obj, max_steps)
    binding = BOUND if engine_status else None
    status = derive_status(obj, Observation(binding=binding, engine_status=engine_status), T0)
    assert status.progress == want and status.to_json()["progress"] == want
    # The step carried over when the engine does not report it (e.g. unreachable).
    again = derive_status({**obj, "status": status.to_json()}, Observation(binding=BOUND), T1)
    assert again.progress == want


def test_a_terminal_status_keeps_its_progress() -> None:
    obj = experiment("a").status(phase="Succeeded", step=50, progress="50/50").obj()
    _with_max_steps(obj, 80)  # the spec changed after it finished: the status stays
    assert derive_status(obj, Observation(), T1).progress == "50/50"


def test_failure_message_carries_engine_error() -> None:
    obs = Observation(
        binding=BOUND, engine_status={**RUNNING_ENGINE, "phase": "Failed", "error": "NaN loss"}
    )
    status = derive_status(experiment("a").obj(), obs, T0)
    assert status.message == "NaN loss"
    assert _reason(status, "Failed") == "EngineReportedFailure"
    assert status.completed_at == "2026-12-02T15:00:00Z"


def test_a_message_too_long_for_a_condition_is_cut() -> None:
    obs = Observation(
        binding=BOUND, engine_status={**RUNNING_ENGINE, "phase": "Failed", "error": "x" * 40000}
    )
    status = derive_status(experiment("a").obj(), obs, T0)
    failed = status.condition("Failed")
    assert failed is not None and len(failed.message) == st.MAX_MESSAGE
    assert status.message == "x" * 40000  # status.message has no limit


def test_pending_reason_comes_from_placement() -> None:
    status = derive_status(experiment("a").obj(), Observation(waiting_reason="NoCapacity"), T0)
    assert _reason(status, "Scheduled") == "NoCapacity"
    patch = status.to_patch()  # merge-patch nulls clear a stale binding
    assert (patch["engine"], patch["node"]) == (None, None)
    assert "engine" not in status.to_json()


def test_the_patch_leaves_out_what_was_never_written() -> None:
    """No null for a field the status never had: a merge patch null deletes, and the
    fields the engine has not reported yet (step, checkpoint, ...) are not deleted."""
    patch = derive_status(experiment("a").obj(), Observation(binding=Binding("e1")), T0).to_patch()
    assert [k for k, v in patch.items() if v is None] == []
    assert "node" not in patch and "step" not in patch  # a binding without a node
    cond_nulls = [k for c in patch["conditions"] for k, v in c.items() if v is None]
    assert cond_nulls == []


def test_admission_problem_is_on_the_admitted_condition() -> None:
    problem = "spec.lora.rank: rank 128 exceeds EnginePool 'pool-a' max rank 64"
    status = derive_status(experiment("a").obj(), Observation(problems=[problem]), T0)
    cond = status.condition("Admitted")
    assert cond is not None
    assert (cond.status, cond.reason, cond.message) == (
        "False",
        "AdmissionFailed",
        problem,
    )


def test_transition_time_kept_while_status_unchanged() -> None:
    obj = experiment("a").obj()
    first = derive_status(obj, Observation(binding=BOUND, engine_status=RUNNING_ENGINE), T0)
    obj["status"] = first.to_json()
    later = derive_status(
        obj, Observation(binding=BOUND, engine_status={**RUNNING_ENGINE, "step": 20}), T1
    )
    running = later.condition("Running")
    assert running is not None and running.last_transition_time == "2026-12-02T15:00:00Z"
    assert later.step == 20


def test_transition_time_moves_when_status_flips() -> None:
    obj = experiment("a").obj()
    running = derive_status(obj, Observation(binding=BOUND, engine_status=RUNNING_ENGINE), T0)
    obj["status"] = running.to_json()
    obj["spec"]["suspend"] = True
    suspended = derive_status(obj, Observation(), T1).to_json()
    conditions = {c["type"]: c for c in suspended["conditions"]}
    assert conditions["Running"]["status"] == "False"
    assert conditions["Running"]["lastTransitionTime"] == "2026-12-02T15:05:00Z"
    assert conditions["Admitted"]["lastTransitionTime"] == "2026-12-02T15:00:00Z"


def test_observed_generation_on_status_and_conditions() -> None:
    status = derive_status(experiment("a").generation(7).obj(), Observation(), T0).to_json()
    assert status["observedGeneration"] == 7
    assert {c["observedGeneration"] for c in status["conditions"]} == {7}


def test_suspend_keeps_last_checkpoint_for_resume() -> None:
    obj = experiment("a").obj()
    running = derive_status(obj, Observation(binding=BOUND, engine_status=RUNNING_ENGINE), T0)
    obj["status"] = running.to_json()
    obj["spec"]["suspend"] = True
    status = derive_status(obj, Observation(), T1)
    assert status.checkpoint is not None and status.checkpoint.step == 10
    assert status.engine is None


@pytest.mark.parametrize("terminal", ["Succeeded", "Failed"])
def test_terminal_phases_are_sticky(terminal: str) -> None:
    obj = experiment("a").status(phase=terminal, step=50).obj()
    status = derive_status(obj, Observation(binding=BOUND, engine_status=RUNNING_ENGINE), T1)
    assert status.phase == terminal and status.step == 50
    # Sent back as it was (plus the generic conditions it lacked), with this generation:
    # nothing deleted, nothing of the engine's.
    patch = status.to_patch()
    assert patch.pop("conditions") and patch.pop("progress") == "50/50"  # it lacked them
    assert patch == {**obj["status"], "observedGeneration": 1}


def test_a_terminal_status_written_before_the_generic_conditions_gets_them() -> None:
    obj = experiment("a").status(phase="Failed", step=3).obj()
    obj["status"]["conditions"] = [
        {"type": "Failed", "status": "True", "reason": "RestartBudgetExhausted",
         "message": "", "lastTransitionTime": "2026-12-01T00:00:00Z"},
    ]  # fmt: skip
    status = derive_status(obj, Observation(), T1)
    stalled = status.condition("Stalled")
    assert stalled is not None
    assert (stalled.status, stalled.reason) == ("True", "RestartBudgetExhausted")
    assert get_condition(status.to_json()["conditions"], "Failed") == obj["status"]["conditions"][0]
    written = {**obj, "status": status.to_json()}
    again = derive_status(written, Observation(), T1 + timedelta(hours=1))
    assert again.conditions == status.conditions  # nothing moves once they are there


GENERIC = ("Ready", "Reconciling", "Stalled")


@pytest.mark.parametrize(
    ("phase", "reason", "want"),
    [
        ("Pending", "WaitingForEngine", ("False", "True", "False")),
        ("Pending", "WaitingForAdmission", ("False", "True", "False")),
        ("Pending", "EngineUnschedulable", ("False", "True", "False")),
        ("Pending", "NoCapacity", ("False", "True", "False")),
        ("Pending", "Preempted", ("False", "True", "False")),
        ("Pending", "AdmissionFailed", ("False", "False", "True")),
        ("Pending", "Unschedulable", ("False", "False", "True")),
        ("Scheduled", "Bound", ("False", "True", "False")),
        ("Running", "Training", ("True", "False", "False")),
        ("Suspended", "SuspendRequested", ("False", "False", "False")),
        ("Succeeded", "MaxStepsReached", ("True", "False", "False")),
        ("Failed", "EngineReportedFailure", ("False", "False", "True")),
        ("Failed", "RestartBudgetExhausted", ("False", "False", "True")),
    ],
)
def test_generic_conditions_of_every_phase(
    phase: str, reason: str, want: tuple[str, str, str]
) -> None:
    conditions = {c["type"]: c for c in st.generic_conditions(phase, reason, "why")}
    assert tuple(conditions[t]["status"] for t in GENERIC) == want
    assert conditions["Ready"]["reason"] == reason  # Ready always says why
    for type_ in ("Reconciling", "Stalled"):  # the reason when True, Not<Type> when False
        on = conditions[type_]["status"] == "True"
        assert conditions[type_]["reason"] == (reason if on else f"Not{type_}")
        assert conditions[type_]["message"] == ("why" if on else "")


def test_kubectl_wait_for_ready_sees_running_and_succeeded() -> None:
    """`kubectl wait --for=condition=Ready` returns once it trains or has finished."""
    pending = derive_status(experiment("a").obj(), Observation(), T0)
    running = derive_status(
        experiment("a").obj(), Observation(binding=BOUND, engine_status=RUNNING_ENGINE), T0
    )
    assert not is_true(pending.to_json()["conditions"], "Ready")
    assert is_true(running.to_json()["conditions"], "Ready")


def test_restarts_recorded() -> None:
    status = derive_status(experiment("a").obj(), Observation(restarts=2), T0)
    assert status.restarts == 2 and status.phase == "Pending"


def test_status_validates_against_the_crd() -> None:
    obj = experiment("a").obj()
    status = derive_status(obj, Observation(binding=BOUND, engine_status=RUNNING_ENGINE), T0)
    obj["status"] = status.to_json()
    status_schema = schema_of("LoRAExperiment")["properties"]["status"]
    assert schema_errors(status_schema, obj["status"]) == []


def test_merge_conditions_keeps_foreign_types() -> None:
    custom = Condition(type="Custom", status="True", reason="X", message="", lastTransitionTime="t")
    merged = merge_conditions(
        [custom], [{"type": "Ready", "status": "True", "reason": "R", "message": ""}], 1, T0
    )
    assert [c.type for c in merged] == ["Ready", "Custom"]
    assert merged[1] == custom  # as another writer left it


def test_the_status_model_knows_every_phase() -> None:
    assert set(st.EXPERIMENT_PHASES) == set(get_args(ExperimentPhase))


def _pool(**kw: Any) -> dict[str, Any]:
    counts = {"engines": 0, "ready": 0, "slots_used": 0, "slots_free": 0, **kw}
    status = pool_status(st.PoolObservation(**counts), generation=4, old_conditions=None, now=T0)
    return status.to_json()  # as the operator patches it


def _conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_pool_status_lists_the_plugins_a_ready_engine_reports() -> None:
    """The engines' /v1/capacity `plugins`, copied: what specs of this pool may name."""
    plugins = {"rewards": ["says-target"], "environments": ["word-tool", "gsm8k"]}
    status = _pool(engines=1, ready=1, plugins=plugins)
    assert status["plugins"] == plugins
    assert schema_errors(schema_of("EnginePool")["properties"]["status"], status) == []
    assert "plugins" not in _pool(engines=1, ready=0)  # none ready: not known


def test_pool_status_repeats_the_plugin_allowlist_the_engines_report() -> None:
    """/v1/capacity `plugins.allowed` (the grants an engine enforces), in status.plugins."""
    allowed = [
        {"namespaces": ["team-b"], "rewards": ["acme-format"], "environments": []},
        {"namespaces": None, "rewards": [], "environments": ["gsm8k-calculator"]},
    ]
    plugins = {"rewards": ["acme-format"], "environments": ["gsm8k-calculator"]}
    status = _pool(engines=1, ready=1, plugins={**plugins, "allowed": allowed})
    assert status["plugins"]["allowed"] == [
        {"namespaces": ["team-b"], "rewards": ["acme-format"], "environments": []},
        {"rewards": [], "environments": ["gsm8k-calculator"]},  # every namespace: absent
    ]
    assert schema_errors(schema_of("EnginePool")["properties"]["status"], status) == []
    open_pool = _pool(engines=1, ready=1, plugins={**plugins, "allowed": None})
    assert "allowed" not in open_pool["plugins"]  # no allowlist: every plug-in for all


def test_the_pool_observation_takes_the_plugins_of_a_ready_engine() -> None:
    from loraplex_operator.observation import pool_observation

    from tests.support.reconcile_inputs import engine, snap

    plugins = {"rewards": ["acme-format"], "environments": ["gsm8k"]}
    views = [engine("e0"), engine("e1")]
    views[1].capacity = {**(views[1].capacity or {}), "plugins": plugins}
    assert pool_observation(snap([], views)).plugins == plugins
    views[1].reachable = False  # its last answer is no news
    assert pool_observation(snap([], views)).plugins is None


def test_pool_status_counts_and_schema() -> None:
    status = _pool(engines=3, ready=2, slots_used=5, slots_free=7)
    counts = (status["engines"], status["ready"], status["slotsUsed"], status["slotsFree"])
    assert counts == (3, 2, 5, 7)
    assert all(c["observedGeneration"] == 4 for c in status["conditions"])
    status_schema = schema_of("EnginePool")["properties"]["status"]
    assert schema_errors(status_schema, status) == []
    gated = _pool(engines=2, ready=1, gated=["p-engine-b"], min_replicas=1)
    assert schema_errors(status_schema, gated) == []


@pytest.mark.parametrize(
    ("counts", "want"),
    [
        (  # every engine ready
            {"engines": 2, "ready": 2},
            {"Ready": ("True", "EnginesReady"), "Reconciling": ("False", "NotReconciling")},
        ),
        (  # scaled to zero with nothing to do: at rest, not waiting for anything
            {"engines": 0, "ready": 0},
            {"Ready": ("True", "ScaledToZero"), "Stalled": ("False", "NotStalled")},
        ),
        (  # one engine still loading its model
            {"engines": 2, "ready": 1},
            {"Ready": ("False", "EnginesStarting"), "Reconciling": ("True", "EnginesStarting")},
        ),
        (  # fewer ready than replicas.min (the missing pod not even created yet)
            {"engines": 0, "ready": 0, "min_replicas": 1},
            {"Ready": ("False", "EnginesStarting"), "Reconciling": ("True", "EnginesStarting")},
        ),
        (  # Kueue holds an engine pod behind its admission gate
            {"engines": 2, "ready": 1, "gated": ["p-engine-b"]},
            {
                "Ready": ("False", "WaitingForAdmission"),
                "Reconciling": ("True", "WaitingForAdmission"),
                "CapacityPending": ("True", "WaitingForAdmission"),
            },
        ),
        (  # no node fits an engine pod
            {"engines": 1, "ready": 0, "unschedulable": ["p-engine-a"]},
            {
                "Ready": ("False", "Unschedulable"),
                "CapacityPending": ("True", "Unschedulable"),
                "Stalled": ("False", "NotStalled"),
            },
        ),
        (  # no token Secret: no engine starts until someone creates it
            {"engines": 1, "ready": 0, "token_found": False},
            {
                "Ready": ("False", "TokenSecretMissing"),
                "Stalled": ("True", "TokenSecretMissing"),
                "Reconciling": ("False", "NotReconciling"),
                "CapacityPending": ("False", "CapacityAvailable"),
            },
        ),
    ],
    ids=lambda v: ",".join(f"{k}={v[k]}" for k in v) if "engines" in v else "",
)
def test_pool_conditions(counts: dict[str, Any], want: dict[str, tuple[str, str]]) -> None:
    got = _conditions(_pool(**counts))
    assert {k: got[k] for k in want} == want


def test_pool_capacity_pending_names_the_pods() -> None:
    status = _pool(engines=3, ready=1, gated=["p-engine-b", "p-engine-c"])
    pending = get_condition(status["conditions"], "CapacityPending")
    assert pending is not None
    assert "p-engine-b, p-engine-c" in pending["message"]
    reconciling = get_condition(status["conditions"], "Reconciling")
    assert reconciling is not None and "1/3 engines ready" in reconciling["message"]


def test_pool_ready_keeps_its_transition_time_while_unchanged() -> None:
    first = pool_status(st.PoolObservation(1, 1, 0, 1), 4, None, T0)
    again = pool_status(st.PoolObservation(1, 1, 1, 0), 5, first.conditions, T1)
    ready = again.condition("Ready")
    assert ready is not None and ready.last_transition_time == st.rfc3339(T0)
    assert ready.observed_generation == 5
    lost = pool_status(st.PoolObservation(1, 0, 0, 0), 5, again.conditions, T1)
    ready = lost.condition("Ready")
    assert ready is not None and ready.last_transition_time == st.rfc3339(T1)
