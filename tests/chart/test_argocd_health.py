"""The Argo CD health checks the chart ships (charts/loraplex/argocd/*.lua), run by a real
Lua 5.1 (lupa's: Argo CD's gopher-lua is Lua 5.1) against statuses of every phase, each
derived by the operator's own status code (status.py), so the scripts read what the
operator writes. Argo CD runs a health script as a chunk with the object in the global
`obj` and reads the table it returns (`status`, `message`)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import pytest
from loraplex_operator import status as st
from loraplex_operator.engine_failures import PodFailure
from loraplex_operator.resources import Experiment
from lupa import lua51

from tests.support.chart_helpers import CHART, REPO

NOW = datetime(2026, 12, 1, tzinfo=UTC)
SCRIPTS = {"LoRAExperiment": "loraexperiment.lua", "EnginePool": "enginepool.lua"}


def _lua(value: Any, lua: Any) -> Any:
    if isinstance(value, Mapping):
        return lua.table_from({k: _lua(v, lua) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return lua.table_from([_lua(v, lua) for v in value])
    return value


def health(kind: str, obj: Mapping[str, Any]) -> tuple[str, str]:
    lua = lua51.LuaRuntime()
    lua.globals().obj = _lua(obj, lua)
    hs = lua.execute((CHART / "argocd" / SCRIPTS[kind]).read_text())
    return hs["status"], hs["message"]


def experiment(phase_obs: st.Observation | None = None, **spec: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "loraplex.dev/v1alpha1",
        "kind": "LoRAExperiment",
        "metadata": {"name": "e", "namespace": "team-a", "generation": 1, "uid": "u"},
        "spec": {
            "enginePool": "p",
            "lora": {"rank": 4},
            "task": {"name": "target-token"},
            "algorithm": {"maxSteps": 10},
            **spec,
        },
    }
    if phase_obs is not None:
        obj["status"] = st.derive_status(Experiment.from_obj(obj), phase_obs, NOW).to_json()
    return obj


RUNNING = {"phase": "Running", "step": 3}
EXPERIMENTS = {
    "no status yet": (experiment(), "Progressing", "Waiting for the operator"),
    "Pending, waiting for an engine": (
        experiment(st.Observation(waiting_reason="WaitingForEngine")),
        "Progressing",
        "WaitingForEngine",
    ),
    "Pending, admission failed": (
        experiment(st.Observation(problems=["spec.lora.rank: 128 > maxRank 64"])),
        "Degraded",
        "AdmissionFailed: spec.lora.rank: 128 > maxRank 64",
    ),
    "Pending, its engine crash-loops": (
        experiment(
            st.Observation(waiting_reason="CrashLoopBackOff", waiting_message="engine pod x")
        ),
        "Degraded",
        "CrashLoopBackOff",
    ),
    "Scheduled": (
        experiment(st.Observation(binding=st.Binding("e0"))),
        "Progressing",
        "bound to e0",
    ),
    "Running": (
        experiment(st.Observation(binding=st.Binding("e0"), engine_status=RUNNING)),
        "Healthy",
        "training on e0",
    ),
    "Suspended": (experiment(st.Observation(), suspend=True), "Suspended", "suspended"),
    "Succeeded": (
        experiment(st.Observation(engine_status={"phase": "Succeeded", "step": 10})),
        "Healthy",
        "finished at step 10",
    ),
    "Failed": (
        experiment(st.Observation(engine_status={"phase": "Failed", "error": "NaN loss"})),
        "Degraded",
        "NaN loss",
    ),
}


@pytest.mark.parametrize("case", sorted(EXPERIMENTS))
def test_experiment_health(case: str) -> None:
    obj, expected, text = EXPERIMENTS[case]
    status, message = health("LoRAExperiment", obj)
    assert status == expected and text in message, (status, message)


def test_an_experiment_not_yet_observed_at_its_generation_is_progressing() -> None:
    obj = experiment(st.Observation(binding=st.Binding("e0"), engine_status=RUNNING))
    obj["metadata"]["generation"] = 2
    assert health("LoRAExperiment", obj) == (
        "Progressing",
        "Waiting for the operator to observe generation 2",
    )


def pool(obs: st.PoolObservation | None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "loraplex.dev/v1alpha1",
        "kind": "EnginePool",
        "metadata": {"name": "p", "generation": 1},
        "spec": {},
    }
    if obs is not None:
        obj["status"] = st.pool_status(obs, 1, None, NOW).to_json()
    return obj


def counts(engines: int, ready: int, **kw: Any) -> st.PoolObservation:
    return st.PoolObservation(engines=engines, ready=ready, slots_used=0, slots_free=0, **kw)


CRASH = PodFailure("p-engine-x", "CrashLoopBackOff", "exit code 1 (Error): no model", "engine")
POOLS = {
    "no status yet": (pool(None), "Progressing", "Waiting for the operator"),
    "EnginesReady": (pool(counts(2, 2)), "Healthy", "EnginesReady: 2/2 engines ready"),
    "ScaledToZero": (pool(counts(0, 0)), "Healthy", "ScaledToZero"),
    "EnginesStarting": (pool(counts(1, 0)), "Progressing", "EnginesStarting: 0/1"),
    "WaitingForAdmission": (
        pool(counts(1, 0, gated=["p-engine-x"])),
        "Progressing",
        "WaitingForAdmission",
    ),
    "Unschedulable (not yet stalled)": (
        pool(counts(1, 0, unschedulable=["p-engine-x"])),
        "Progressing",
        "Unschedulable",
    ),
    "TokenSecretMissing": (
        pool(counts(0, 0, token_found=False)),
        "Degraded",
        "TokenSecretMissing",
    ),
    "CrashLoopBackOff": (
        pool(counts(1, 0, failures=[CRASH])),
        "Degraded",
        "CrashLoopBackOff: 0/1 engines ready; engine pod p-engine-x container engine: "
        "CrashLoopBackOff: exit code 1 (Error): no model",
    ),
}


@pytest.mark.parametrize("case", sorted(POOLS))
def test_pool_health(case: str) -> None:
    obj, expected, text = POOLS[case]
    status, message = health("EnginePool", obj)
    assert status == expected and text in message, (status, message)


def test_the_docs_show_the_argocd_cm_keys_for_both_scripts() -> None:
    doc = (REPO / "docs" / "design" / "chart.md").read_text()
    for kind, script in SCRIPTS.items():
        assert f"resource.customizations.health.loraplex.dev_{kind}" in doc
        assert f"argocd/{script}" in doc
