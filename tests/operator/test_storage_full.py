"""A full checkpoint volume is a pool condition (pure): an engine whose checkpoints wait
for room says so on /v1/capacity (`storageFull`, the engine's reason); the pool's status
gets `StorageFull` True naming the engine pods and that reason, False once every engine
has written them. The engines train on meanwhile, so the pool stays Ready."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from loraplex_operator import status as st
from loraplex_operator.observation import EngineView, pool_observation

from tests.support.crdkit import schema_errors, schema_of
from tests.support.reconcile_inputs import NOW, engine, snap

NOW_DT = datetime.fromtimestamp(NOW, UTC)
FULL = "the checkpoint volume /ckpt is full (No space left on device)"


def full(view: EngineView, why: str = FULL) -> EngineView:
    view.capacity = {**(view.capacity or {}), "storageFull": why}
    return view


def conditions(obs: st.PoolObservation) -> dict[str, Any]:
    status = st.pool_status(obs, 1, None, NOW_DT).to_json()  # as the operator patches it
    assert schema_errors(schema_of("EnginePool")["properties"]["status"], status) == []
    return {c["type"]: c for c in status["conditions"]}


def test_engines_reporting_a_full_volume_make_the_pool_storage_full() -> None:
    engines = [full(engine("e2")), engine("e1"), full(engine("e0"))]
    obs = pool_observation(snap([], engines))
    assert list(obs.storage_full) == [("e0", FULL), ("e2", FULL)]
    by_type = conditions(obs)
    cond = by_type["StorageFull"]
    assert (cond["status"], cond["reason"]) == ("True", "CheckpointVolumeFull")
    assert cond["message"] == f"checkpoints deferred on engine pods e0, e2: {FULL}"
    assert by_type["Ready"]["status"] == "True"  # they train on


def test_each_distinct_reason_is_named_once() -> None:
    quota = "the checkpoint volume /ckpt is full (Disk quota exceeded)"
    engines = [full(engine("e0")), full(engine("e1"), quota), full(engine("e2"))]
    message = conditions(pool_observation(snap([], engines)))["StorageFull"]["message"]
    assert message == f"checkpoints deferred on engine pods e0, e1, e2: {FULL}; {quota}"


def test_no_engine_reporting_it_is_storage_full_false() -> None:
    engines = [engine("e0"), full(engine("e1"), "")]  # "" and null: nothing pending
    engines[0].capacity = {**(engines[0].capacity or {}), "storageFull": None}
    obs = pool_observation(snap([], engines))
    assert list(obs.storage_full) == []
    cond = conditions(obs)["StorageFull"]
    assert (cond["status"], cond["reason"]) == ("False", "CheckpointsWritten")


def test_only_engines_that_answered_this_round_count() -> None:
    """An unreachable engine's last answer is no news of the volume; nor is a pod being
    deleted (it no longer counts as the pool's)."""
    gone = full(engine("e0"))
    gone.reachable = False
    deleting = full(engine("e1"))
    deleting.deleting_until = NOW + 30
    assert list(pool_observation(snap([], [gone, deleting])).storage_full) == []


def test_storage_full_clears_and_keeps_its_transition_time_while_unchanged() -> None:
    obs = pool_observation(snap([], [full(engine("e0"))]))
    first = st.pool_status(obs, 1, None, NOW_DT)
    later = datetime.fromtimestamp(NOW + 60, UTC)
    again = st.pool_status(obs, 1, first.conditions, later)
    cond = again.condition("StorageFull")
    assert cond is not None and cond.last_transition_time == st.rfc3339(NOW_DT)
    cleared = st.pool_status(pool_observation(snap([], [engine("e0")])), 1, again.conditions, later)
    cond = cleared.condition("StorageFull")
    assert cond is not None and cond.status == "False"
    assert cond.last_transition_time == st.rfc3339(later)
