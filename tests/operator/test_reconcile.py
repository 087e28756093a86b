"""The pool's round planning (pure): adoption, recovery, unloads, binds, preemption,
scale-up and scale-down, admission — from observations, no I/O; and the pipeline's
steps on their own."""

from __future__ import annotations

from datetime import UTC, datetime

from loraplex_operator import placement
from loraplex_operator import status as st
from loraplex_operator.classification import classify
from loraplex_operator.config import Config
from loraplex_operator.observation import EngineView
from loraplex_operator.planning import act_on, placement_inputs, plan_round, scale
from loraplex_operator.publish import derive, status_changes
from loraplex_operator.resources import Experiment, Pool
from loraplex_operator.round_plan import DUPLICATE, FINISHED, ORPHAN, PREEMPT, SUSPEND, Work

from tests.support.builders import experiment, pool
from tests.support.builders import run as run_of
from tests.support.reconcile_inputs import CFG, NOW, engine, exp, snap, timestamp


def test_pending_experiments_bind_to_a_ready_engine_with_resume_from_checkpoint() -> None:
    exps = [
        exp("a"),
        exp(
            "b", created=1, phase="Pending", checkpoint={"path": "/ckpt/team-a/b/step-4", "step": 4}
        ),
    ]
    plan = plan_round(snap(exps, [engine("e1")]), CFG)
    puts = {p.key: p for p in plan.puts}
    assert set(puts) == {"team-a/a", "team-a/b"}
    assert puts["team-a/a"].body["resumeFrom"] is None
    assert puts["team-a/b"].body["resumeFrom"] == "/ckpt/team-a/b/step-4"
    # The run is the object's uid: the engine keeps its checkpoints apart from those of an
    # earlier experiment of the same name, and resumes its newest one unasked.
    assert puts["team-a/a"].body["runId"] == "uid-team-a-a"
    assert puts["team-a/b"].body["runId"] == "uid-team-a-b"
    assert puts["team-a/b"].exp_id == "team-a.b"
    assert puts["team-a/b"].body["spec"]["enginePool"] == "pool-a"
    assert plan.create_pods == 0


def test_an_object_without_uid_is_bound_without_run_id(caplog) -> None:
    # The API server always sets metadata.uid; should one lack it, the bind goes ahead
    # without a runId (the engine makes a run id, as before run ids were sent) and says so.
    obj = exp("a")
    del obj["metadata"]["uid"]
    with caplog.at_level("WARNING", logger="loraplex_operator.planning"):
        plan = plan_round(snap([obj], [engine("e1")]), CFG)
    assert [p.body["runId"] for p in plan.puts] == [None]
    assert "team-a/a has no metadata.uid" in caplog.text


def test_no_engine_scales_up_once_for_a_burst() -> None:
    exps = [exp(f"x{i}", created=i) for i in range(6)]
    plan = plan_round(snap(exps, []), CFG)
    assert plan.create_pods == 2  # 6 onto engines of 4 slots, max 2
    assert not plan.puts
    assert {w.waiting_reason for w in plan.work.values()} == {placement.WAIT_STARTING}


def test_starting_engines_reserve_room_no_second_scale_up() -> None:
    exps = [exp(f"x{i}", created=i) for i in range(3)]
    plan = plan_round(snap(exps, [engine("e1", ready=False)]), CFG)
    assert plan.create_pods == 0 and not plan.puts


def test_running_on_engine_is_adopted_without_a_put_even_if_status_forgot() -> None:
    # Operator restarted between the PUT and the status write: engine is the truth.
    plan = plan_round(snap([exp("a")], [engine("e1", "team-a.a")]), CFG)
    assert not plan.puts and not plan.unloads
    w = plan.work["team-a/a"]
    assert w.binding == st.Binding("e1", "node-1")
    assert [e[1] for e in w.events] == ["Adopted"]
    status = derive(w, CFG, datetime.now(UTC))
    assert (status.phase, status.engine, status.step) == ("Running", "e1", 3)


def test_never_bound_twice_when_running_anywhere() -> None:
    e1 = engine("e1", "team-a.a")
    plan = plan_round(snap([exp("a", phase="Running", engine="e1")], [e1, engine("e2")]), CFG)
    assert not plan.puts


def test_duplicate_on_two_engines_keeps_the_recorded_one() -> None:
    exps = [exp("a", phase="Running", engine="e2")]
    plan = plan_round(snap(exps, [engine("e1", "team-a.a"), engine("e2", "team-a.a")]), CFG)
    assert [(u.engine, u.reason) for u in plan.unloads] == [("e1", DUPLICATE)]
    assert plan.work["team-a/a"].binding.engine == "e2"


def test_engine_gone_recovers_from_checkpoint_with_restart_and_event() -> None:
    ckpt = {"path": "/ckpt/team-a/a/step-00000004", "step": 4}
    exps = [exp("a", phase="Running", engine="gone", step=5, checkpoint=ckpt)]
    plan = plan_round(snap(exps, [engine("e2")]), CFG)
    w = plan.work["team-a/a"]
    assert w.restarts == 1 and plan.recoveries == 1
    assert [p.body["resumeFrom"] for p in plan.puts] == [ckpt["path"]]
    assert plan.puts[0].engine == "e2"
    (type_, reason, message) = w.events[0]
    assert (type_, reason) == ("Warning", "EngineLost")
    assert "gone" in message and "step 4" in message


def test_engine_not_ready_counts_as_lost() -> None:
    exps = [exp("a", phase="Running", engine="e1")]
    plan = plan_round(snap(exps, [engine("e1", ready=False), engine("e2")]), CFG)
    assert plan.work["team-a/a"].restarts == 1
    assert "not ready" in plan.work["team-a/a"].events[0][2]
    assert [p.engine for p in plan.puts] == ["e2"]


def _deleted(view: EngineView, seconds_left: float) -> EngineView:
    view.deleting_until = NOW + seconds_left
    view.pod_ready = view.reachable = False  # the engine stops answering on SIGTERM
    view.experiments = {}
    return view


def test_deleted_engine_is_awaited_while_it_checkpoints_then_recovered() -> None:
    # Recovering while the deleted engine still writes its SIGTERM checkpoint would
    # resume from an older one; so the experiment stays bound until the pod is gone.
    ckpt = {"path": "/ckpt/team-a/a/step-00000004", "step": 4}
    exps = [exp("a", phase="Running", engine="e1", node="node-1", step=5, checkpoint=ckpt)]
    draining = _deleted(engine("e1", "team-a.a"), seconds_left=30)
    plan = plan_round(snap(exps, [draining, engine("e2")], pool().replicas(2, 3).obj()), CFG)
    w = plan.work["team-a/a"]
    assert not plan.puts and w.restarts == 0 and not w.events and plan.recoveries == 0
    assert plan.create_pods == 1  # a replacement: the deleted one no longer counts
    assert "e1" not in plan.delete_pods
    status = derive(w, CFG, datetime.now(UTC))
    assert (status.phase, status.engine, status.node) == ("Running", "e1", "node-1")
    assert (status.step, status.to_json()["checkpoint"], status.restarts) == (5, ckpt, 0)

    # Past its grace period the kubelet has killed it (or its node is gone): recover.
    overdue = _deleted(engine("e1"), seconds_left=-1)
    plan = plan_round(snap(exps, [overdue, engine("e2")]), CFG)
    assert [p.body["resumeFrom"] for p in plan.puts] == [ckpt["path"]]
    assert "grace period" in plan.work["team-a/a"].events[0][2]


def test_failed_pod_is_replaced() -> None:
    dead = engine("e1", ready=False)
    dead.pod_phase = "Failed"
    p = pool().slots(4).replicas(1, 2).obj()
    plan = plan_round(snap([], [dead], p), CFG)
    assert plan.delete_pods == ["e1"] and plan.create_pods == 1


def test_restart_budget_turns_into_failed() -> None:
    exps = [exp("a", phase="Running", engine="gone", restarts=2)]
    plan = plan_round(snap(exps, [engine("e2")]), CFG)
    w = plan.work["team-a/a"]
    assert not plan.puts
    status = derive(w, CFG, datetime.now(UTC))
    assert status.phase == "Failed" and status.restarts == 3
    assert "budget" in str(status.message)
    assert w.events[0][1] == "RestartBudgetExhausted"


def test_finished_experiment_is_recorded_then_unloaded_next_round() -> None:
    done = {"team_a_a": {"phase": "Succeeded", "step": 8, "adapterPath": "/ckpt/a/step-8"}}
    e1 = engine("e1", "team-a.a", **done)
    first = plan_round(snap([exp("a", phase="Running", engine="e1")], [e1]), CFG)
    assert not first.unloads
    status = derive(first.work["team-a/a"], CFG, datetime.now(UTC))
    assert status.phase == "Succeeded" and status.adapter_path == "/ckpt/a/step-8"
    assert status.engine == "e1"
    second = plan_round(snap([exp("a", **status.to_json())], [e1]), CFG)
    assert [(u.engine, u.reason) for u in second.unloads] == [("e1", FINISHED)]


def test_suspend_unloads_and_frees_the_slot_unsuspend_resumes() -> None:
    obj = experiment("a").suspend().status(phase="Running", engine="e1").obj()
    plan = plan_round(snap([obj], [engine("e1", "team-a.a")]), CFG)
    assert [(u.reason, u.engine) for u in plan.unloads] == [(SUSPEND, "e1")]
    # Once unloaded (status Suspended with its checkpoint), nothing binds it...
    ckpt = {"path": "/ckpt/team-a/a/step-2", "step": 2}
    obj = experiment("a").suspend().status(phase="Suspended", checkpoint=ckpt).obj()
    assert not plan_round(snap([obj], [engine("e1")]), CFG).puts
    # ...until suspend is cleared: resume from the checkpoint.
    obj["spec"]["suspend"] = False
    puts = plan_round(snap([obj], [engine("e1")]), CFG).puts
    assert [p.body["resumeFrom"] for p in puts] == [ckpt["path"]]


def test_checkpoint_edit_reaches_the_engine_at_the_next_placement() -> None:
    """spec.checkpoint may be edited (the CRD allows it): the running copy is left alone
    (no PUT: the engine would answer 409), the next bind carries the edited settings."""
    obj = experiment("a").checkpoint(everySteps=5).status(phase="Running", engine="e1").obj()
    plan = plan_round(snap([obj], [engine("e1", "team-a.a")]), CFG)
    assert not plan.puts and not plan.unloads
    ckpt = {"path": "/ckpt/team-a/a/step-2", "step": 2}
    obj = experiment("a").checkpoint(everySteps=5).status(phase="Suspended", checkpoint=ckpt).obj()
    puts = plan_round(snap([obj], [engine("e1")]), CFG).puts
    assert [(p.body["spec"]["checkpoint"], p.body["resumeFrom"]) for p in puts] == [
        ({"everySteps": 5}, ckpt["path"])
    ]


def test_orphan_on_engine_is_unloaded() -> None:
    plan = plan_round(snap([], [engine("e1", "team-a.deleted")]), CFG)
    assert [(u.exp_id, u.reason) for u in plan.unloads] == [("team-a.deleted", ORPHAN)]


def test_deleting_experiment_is_left_to_the_finalizer() -> None:
    obj = experiment("a").set("metadata.deletionTimestamp", timestamp(NOW)).obj()
    plan = plan_round(snap([obj], [engine("e1", "team-a.a")]), CFG)
    assert not plan.unloads and not plan.puts and "team-a/a" not in plan.work


def test_preemption_of_lower_priority_when_full() -> None:
    running = [exp(f"low{i}", phase="Running", engine="e1") for i in range(4)]
    high = exp("high", created=10)
    high["spec"]["priorityClassName"] = "high"
    e1 = engine("e1", *(f"team-a.low{i}" for i in range(4)))
    p = pool().slots(4).replicas(0, 1).priority_class("high", 10).obj()
    plan = plan_round(snap([*running, high], [e1], p), CFG)
    preempts = [u for u in plan.unloads if u.reason == PREEMPT]
    assert len(preempts) == 1 and preempts[0].for_key == "team-a/high"
    assert plan.work["team-a/high"].waiting_reason == placement.WAIT_PREEMPTING
    assert not plan.puts


def test_admission_problem_names_the_field_and_blocks_binding() -> None:
    obj = experiment("big").rank(128).obj()
    plan = plan_round(snap([obj], [engine("e1")], pool().max_rank(32).obj()), CFG)
    assert not plan.puts
    w = plan.work["team-a/big"]
    assert any(pr.startswith("spec.lora.rank") for pr in w.problems)
    status = derive(w, CFG, datetime.now(UTC))
    admitted = status.condition(st.ADMITTED)
    assert admitted is not None
    assert admitted.status == "False" and "spec.lora.rank" in admitted.message


def test_scale_down_idle_engines_above_min_after_delay() -> None:
    p = pool().slots(4).replicas(1, 3).obj()
    engines = [engine("e1", "team-a.a"), engine("e2"), engine("e3")]
    exps = [exp("a", phase="Running", engine="e1")]
    first = plan_round(snap(exps, engines, p), CFG)
    assert first.delete_pods == []  # idle, but not for long enough yet
    assert set(first.idle_since) == {"e2", "e3"}
    later = snap(exps, engines, p, idle_since={"e2": NOW - 60, "e3": NOW - 60})
    assert sorted(plan_round(later, CFG).delete_pods) == ["e2", "e3"]
    # never below min: with nothing running, one idle engine stays
    idle_all = snap([], engines[1:], p, idle_since={"e2": NOW - 60, "e3": NOW - 60})
    assert len(plan_round(idle_all, CFG).delete_pods) == 1


def test_min_replicas_are_kept() -> None:
    plan = plan_round(snap([], [], pool().replicas(2, 3).obj()), CFG)
    assert plan.create_pods == 2


def test_status_changes_sees_removed_fields() -> None:
    assert status_changes({"engine": "e1"}, {"engine": None}) == {"engine"}
    assert status_changes({}, {"engine": None}) == set()
    assert status_changes({"step": 1}, {"step": 2}) == {"step"}


def test_work_ids() -> None:
    w = Work.start(Experiment.from_obj(experiment("x", namespace="ns1").obj()))
    assert (w.key, w.id) == ("ns1/x", "ns1.x")


def test_config_from_env() -> None:
    env = {
        "LORAPLEX_RECONCILE_INTERVAL": "2",
        "LORAPLEX_MAX_RESTARTS": "5",
        "LORAPLEX_WATCH_NAMESPACES": "team-b,team-a",
    }
    cfg = Config.from_env(env)
    assert (cfg.interval, cfg.max_restarts, cfg.namespaces) == (2.0, 5, ("team-b", "team-a"))
    assert Config.from_env({}).namespaces == ()


# --- the pipeline's steps on their own ------------------------------------------------


def test_placement_inputs_take_what_engines_report_over_the_pool_spec() -> None:
    p = Pool.from_obj(pool().slots(4).max_rank(32).memory(1000).replicas(0, 3).obj())
    reporting = engine("e1", "team-a.a", slots=6)  # says maxAdapters 6, maxRank 64
    starting = engine("e2", ready=False)
    a = run_of("team-a/a", memory=300)
    inputs, lim = placement_inputs(p.spec, [reporting, starting], {"e1": [a]})
    by_name = {e.name: e for e in inputs}
    assert (by_name["e1"].slots_total, by_name["e1"].max_rank) == (6, 64)
    assert (by_name["e1"].slots_used, by_name["e1"].memory_used) == (1, 300)
    assert by_name["e1"].running == (a,)
    # a starting engine is reserved at the pool's shape, never bound to
    assert not by_name["e2"].ready and (by_name["e2"].slots_total, by_name["e2"].max_rank) == (
        4,
        32,
    )
    assert (lim.max_replicas, lim.current_replicas, lim.memory_budget) == (3, 2, 1000)


def test_classify_sorts_experiments_into_adopted_pending_and_unloaded() -> None:
    exps = [
        exp("run", phase="Running", engine="e1"),
        exp("new"),
        exp("done", phase="Succeeded", engine="e1"),
        experiment("off").suspend().obj(),
    ]
    held = engine("e1", "team-a.run", "team-a.done", "team-a.gone")
    out = classify(snap(exps, [held]), [held], CFG)
    assert sorted(out.work) == ["team-a/done", "team-a/new", "team-a/off", "team-a/run"]
    assert [p.key for p in out.pending] == ["team-a/new"]
    assert [r.key for r in out.running_on["e1"]] == ["team-a/run"]
    assert sorted((u.exp_id, u.reason) for u in out.unloads) == [
        ("team-a.done", FINISHED),
        ("team-a.gone", ORPHAN),
    ]


def test_act_on_turns_decisions_into_engine_calls() -> None:
    e1 = engine("e1", "team-a.low")
    work = {
        k: Work.start(Experiment.from_obj(exp(k.split("/")[1])))
        for k in ("team-a/a", "team-a/low", "team-a/b", "team-a/c")
    }
    decisions = [
        placement.ScaleUp(2),
        placement.Bind("team-a/a", "e1"),
        placement.Preempt("team-a/low", "e1", "team-a/b"),
        placement.Wait("team-a/c", placement.WAIT_UNSCHEDULABLE),
    ]
    acts = act_on(decisions, work, {"e1": e1})
    assert [(p.key, p.engine, p.body["runId"]) for p in acts.puts] == [
        ("team-a/a", "e1", "uid-team-a-a")
    ]
    assert [(u.key, u.reason, u.for_key) for u in acts.unloads] == [
        ("team-a/low", PREEMPT, "team-a/b")
    ]
    assert (acts.create_pods, acts.bound_to) == (2, {"e1"})
    # nothing waits for room that can come: an unschedulable experiment does not hold
    # idle engines up
    assert not acts.waiting and work["team-a/c"].waiting_reason == placement.WAIT_UNSCHEDULABLE


def test_scale_tops_up_to_min_and_removes_only_long_idle_engines() -> None:
    p = pool().replicas(1, 3).obj()
    engines = [engine("e1"), engine("e2"), engine("e3", "team-a.a")]
    s = scale(snap([], engines, p, idle_since={"e1": NOW - 60}), engines, CFG, 0, set(), False)
    assert s.create_pods == 0 and s.delete_pods == ["e1"]  # e2 idle only since now
    assert s.idle_since == {"e1": NOW - 60, "e2": NOW}
    waiting = scale(snap([], engines, p, idle_since={"e1": NOW - 60}), engines, CFG, 0, set(), True)
    assert waiting.delete_pods == []  # something waits for room: keep every engine
    assert (
        scale(snap([], [], pool().replicas(2, 3).obj()), [], CFG, 1, set(), False).create_pods == 2
    )
