"""The reconciler's act step against in-memory stand-ins for the API server and engine
client: what reaches the status and the Events when engines answer, refuse or vanish.
(The scenarios with real engines and a real operator process are test_operator_e2e.py.)"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import httpx
from loraplex_operator.config import Config
from loraplex_operator.engine_client import EngineClient, EngineError, EngineUnreachable
from loraplex_operator.observation import EngineView, Snapshot
from loraplex_operator.publish import StatusPublisher
from loraplex_operator.reconcile import PUT_ATTEMPTS, PoolReconciler, PutBackoff
from loraplex_operator.resources import Experiment, Pool, parse_time
from loraplex_operator.round_plan import PREEMPT, SUSPEND, Put, RoundPlan, Unload, Work
from loraplex_operator.status import Binding

from tests.support.builders import experiment, pool

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)


class FakeKube:
    def __init__(self, objects: list[dict[str, Any]] | None = None) -> None:
        self.objects = objects or []
        self.patches: list[tuple[str, dict[str, Any]]] = []
        self.created: list[dict[str, Any]] = []
        self.deleted: list[str] = []

    async def list(self, res: Any, ns: str | None = None, **kw: Any) -> list[dict[str, Any]]:
        return [dict(o) for o in self.objects]

    async def get(self, res: Any, name: str, ns: str | None = None) -> dict[str, Any] | None:
        return next((o for o in self.objects if o["metadata"]["name"] == name), None)

    async def patch(self, res: Any, name: str, patch: dict[str, Any], **kw: Any) -> dict:
        self.patches.append((name, patch))
        return {}

    async def create(self, res: Any, body: dict[str, Any], ns: str | None = None) -> dict:
        self.created.append(body)
        return body

    async def delete(self, res: Any, name: str, ns: str | None = None) -> bool:
        self.deleted.append(name)
        return True


class FakeEngines:
    def __init__(self, put: Any = None, delete: Any = None) -> None:
        self._put, self._delete = put, delete

    async def capacity(self, *args: Any) -> dict[str, Any]:
        raise EngineUnreachable("connection refused")

    async def list(self, *args: Any) -> list[dict[str, Any]]:
        raise EngineUnreachable("connection refused")

    async def put(self, *args: Any) -> tuple[int, dict[str, Any]]:
        if isinstance(self._put, Exception):
            raise self._put
        return self._put

    async def delete(self, *args: Any) -> dict[str, Any] | None:
        if isinstance(self._delete, Exception):
            raise self._delete
        return self._delete


def _reconciler(engines: FakeEngines) -> tuple[PoolReconciler, FakeKube, list[tuple]]:
    kube, events = FakeKube(), []
    r = PoolReconciler(
        kube,  # type: ignore[arg-type]
        engines,  # type: ignore[arg-type]
        Config(status_interval=0),
        emit=lambda obj, t, reason, msg: events.append((obj["metadata"]["name"], t, reason, msg)),
    )
    return r, kube, events


def _snap(*objs: dict[str, Any]) -> Snapshot:
    exps = [Experiment.from_obj(o) for o in objs]
    return Snapshot(pool=Pool.from_obj(pool().obj()), experiments=exps, engines=[], now=0.0)


def _round(obj: dict[str, Any], puts=(), unloads=()) -> tuple[Snapshot, RoundPlan]:
    w = Work(Experiment.from_obj(obj))
    snap = _snap(obj)
    return snap, RoundPlan(work={w.key: w}, puts=list(puts), unloads=list(unloads))


def _put(obj: dict[str, Any], resume: str | None = None) -> Put:
    body = {
        "spec": obj["spec"],
        "namespace": "team-a",
        "name": "a",
        "resumeFrom": resume,
        "runId": obj["metadata"].get("uid"),
    }
    return Put("e1", "http://e1", "node-1", "team-a/a", "team-a.a", body)


def _status(kube: FakeKube) -> dict[str, Any]:
    return next(p["status"] for n, p in kube.patches if n == "a")


def _latest_status(kube: FakeKube) -> dict[str, Any]:
    return [p["status"] for n, p in kube.patches if n == "a"][-1]


async def test_bind_writes_engine_node_and_running() -> None:
    obj = experiment("a").obj()
    ckpt = {"path": "/ckpt/team-a/a/step-00000004", "step": 4}
    running = {"id": "team-a.a", "phase": "Running", "step": 4, "checkpoint": ckpt}
    r, kube, events = _reconciler(FakeEngines(put=(201, running)))
    snap, plan = _round(obj, puts=[_put(obj, ckpt["path"])])
    await r.act(snap, plan, "token")
    s = _status(kube)
    assert (s["phase"], s["engine"], s["node"]) == ("Running", "e1", "node-1")
    assert [e[2] for e in events] == ["Bound"]
    assert events[0][3] == f"bound to engine e1 (resumed from step 4: {ckpt['path']})"


async def test_resume_records_the_checkpoint_the_engine_actually_loaded() -> None:
    # The engine resumed from a newer checkpoint of the run (its SIGTERM one) than the one
    # status recorded: status and the Bound event follow the engine.
    older = {"path": "/ckpt/team-a/a/step-00000004", "step": 4}
    obj = experiment("a").status(phase="Pending", step=5, checkpoint=older).obj()
    newer = {"path": "/ckpt/team-a/a/step-00000006", "step": 6}
    running = {"id": "team-a.a", "phase": "Running", "step": 6, "checkpoint": newer}
    r, kube, events = _reconciler(FakeEngines(put=(201, running)))
    snap, plan = _round(obj, puts=[_put(obj, older["path"])])
    await r.act(snap, plan, "token")
    s = _status(kube)
    assert (s["phase"], s["step"], s["checkpoint"]) == ("Running", 6, newer)
    assert events[0][2] == "Bound"
    assert f"resumed from step 6, requested step 4: {newer['path']}" in events[0][3]


async def test_the_put_carries_the_uid_as_run_id_and_records_the_runs_newest_checkpoint() -> None:
    # Status never recorded a checkpoint (the engine stopped first): the PUT names only
    # the run, the engine resumes its newest checkpoint, and status and Event say so.
    obj = experiment("a").status(phase="Pending", restarts=1).obj()
    sent: list[dict[str, Any]] = []
    ckpt = {"path": "/ckpt/team-a/a/uid-team-a-a/step-00000003", "step": 3}

    def engine(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        status = {"id": "team-a.a", "phase": "Running", "step": 3, "checkpoint": ckpt}
        return httpx.Response(201, json=status)

    client = EngineClient(transport=httpx.MockTransport(engine))
    r, kube, events = _reconciler(client)  # type: ignore[arg-type]
    snap, plan = _round(obj, puts=[_put(obj)])
    await r.act(snap, plan, "token")
    await client.close()
    assert [(b["runId"], b["resumeFrom"]) for b in sent] == [("uid-team-a-a", None)]
    s = _status(kube)
    assert (s["phase"], s["step"], s["checkpoint"]) == ("Running", 3, ckpt)
    assert events[0][3] == (
        f"bound to engine e1 (resumed from step 3, its run's newest checkpoint: {ckpt['path']})"
    )


async def test_engine_rejecting_the_spec_fails_it_naming_the_field() -> None:
    obj = experiment("a").obj()
    err = EngineError(422, "invalid_spec", "unknown task parameter", "spec.task.params")
    r, kube, events = _reconciler(FakeEngines(put=err))
    snap, plan = _round(obj, puts=[_put(obj)])
    await r.act(snap, plan, "token")
    s = _status(kube)
    assert s["phase"] == "Failed" and "spec.task.params" in s["message"]
    assert events[0][:3] == ("a", "Warning", "EngineRejected")


async def test_full_or_unreachable_engine_leaves_it_pending() -> None:
    for err in (EngineError(409, "no_capacity", "full"), EngineUnreachable("refused")):
        obj = experiment("a").obj()
        r, kube, _ = _reconciler(FakeEngines(put=err))
        snap, plan = _round(obj, puts=[_put(obj)])
        await r.act(snap, plan, "token")
        s = _status(kube)
        assert s["phase"] == "Pending" and s["engine"] is None


class CountingEngines(FakeEngines):
    def __init__(self, put: Any) -> None:
        super().__init__(put=put)
        self.puts = 0

    async def put(self, *args: Any) -> tuple[int, dict[str, Any]]:
        self.puts += 1
        return await super().put(*args)


async def test_an_engine_5xx_on_put_is_retried_with_back_off_then_fails_it() -> None:
    # Issue 26: a 500 is the engine's fault, not a lack of room: never "NoCapacity", never
    # retried every round for ever. One round a second: PUTs at 0, 5, 15, 35 and 75 s.
    obj = experiment("a").obj()
    engines = CountingEngines(put=EngineError(500, "internal", "RecursionError"))
    r, kube, events = _reconciler(engines)
    clock = [0.0]
    r.put_backoff[Pool.from_obj(pool().obj()).name] = PutBackoff(lambda: clock[0])
    sent_at = []
    for _ in range(120):
        before = engines.puts
        await r.act(*_round(obj, puts=[_put(obj)]), "token")
        if engines.puts > before:
            sent_at.append(clock[0])
        s = _latest_status(kube)
        if s["phase"] == "Failed":
            break
        assert s["phase"] == "Pending" and "EngineError" in s["message"], s
        clock[0] += 1.0
    assert sent_at == [0.0, 5.0, 15.0, 35.0, 75.0]
    assert f"answered 500 to bind {PUT_ATTEMPTS}/{PUT_ATTEMPTS}" in s["message"], s
    warnings = [e for e in events if e[2] == "EngineError"]
    assert len(warnings) == PUT_ATTEMPTS and "giving up" in warnings[-1][3]


async def test_an_unavailable_engine_is_waited_for_not_counted() -> None:
    obj = experiment("a").obj()
    engines = CountingEngines(put=EngineError(503, "unavailable", "loading"))
    r, kube, _ = _reconciler(engines)
    for _ in range(PUT_ATTEMPTS + 2):
        snap, plan = _round(obj, puts=[_put(obj)])
        await r.act(snap, plan, "token")
        s = _latest_status(kube)
        assert s["phase"] == "Pending" and "WaitingForEngine" in s["message"], s
    assert engines.puts == PUT_ATTEMPTS + 2


async def test_preempted_victim_goes_pending_with_its_checkpoint() -> None:
    obj = experiment("a").status(phase="Running", engine="e1").obj()
    final = {"id": "team-a.a", "phase": "Running", "step": 7}
    final["checkpoint"] = {"path": "/ckpt/team-a/a/step-00000007", "step": 7}
    r, kube, events = _reconciler(FakeEngines(delete=final))
    unload = Unload("e1", "http://e1", "team-a.a", "team-a/a", PREEMPT, "team-a/high")
    snap, plan = _round(obj, unloads=[unload])
    await r.act(snap, plan, "token")
    s = _status(kube)
    assert s["phase"] == "Pending" and s["engine"] is None
    assert s["checkpoint"] == {"path": "/ckpt/team-a/a/step-00000007", "step": 7}
    assert events[0][2] == "Preempted" and "team-a/high" in events[0][3]


async def test_suspend_records_the_final_checkpoint() -> None:
    obj = experiment("a").suspend().status(phase="Running", engine="e1").obj()
    final = {"id": "team-a.a", "phase": "Running", "step": 5}
    final["checkpoint"] = {"path": "/ckpt/team-a/a/step-00000005", "step": 5}
    r, kube, events = _reconciler(FakeEngines(delete=final))
    unload = Unload("e1", "http://e1", "team-a.a", "team-a/a", SUSPEND)
    snap, plan = _round(obj, unloads=[unload])
    await r.act(snap, plan, "token")
    s = _status(kube)
    assert s["phase"] == "Suspended" and s["checkpoint"]["step"] == 5 and s["engine"] is None
    assert events[0][2] == "Suspended"


async def test_unchanged_status_is_not_rewritten() -> None:
    obj = experiment("a").obj()
    r, kube, _ = _reconciler(FakeEngines())
    snap, plan = _round(obj)
    await r.act(snap, plan, "token")
    first = _status(kube)
    obj["status"] = first
    kube.patches.clear()
    snap, plan = _round(obj)
    await r.act(snap, plan, "token")
    assert not [p for n, p in kube.patches if n == "a"]


async def test_progress_only_change_waits_for_the_status_interval_a_phase_change_does_not() -> None:
    # A busy engine moves `step` every few tens of milliseconds; writing each one would
    # flood the API server, so only phase (and other non-progress) changes skip the wait.
    obj = experiment("a").algorithm(maxSteps=40).obj()
    kube = FakeKube()
    r = PoolReconciler(
        kube,  # type: ignore[arg-type]
        FakeEngines(),  # type: ignore[arg-type]
        Config(status_interval=3600),
        emit=lambda *_: None,
    )

    async def round_with(engine_status: dict[str, Any]) -> dict[str, Any] | None:
        """One round with the engine reporting `engine_status`; the status written, if any
        (stored back on the object, as the API server would)."""
        w = Work(
            Experiment.from_obj(obj), binding=Binding("e1", "node-1"), engine_status=engine_status
        )
        snap = _snap(obj)
        kube.patches.clear()
        await r.act(snap, RoundPlan(work={w.key: w}), "token")
        written = [p["status"] for n, p in kube.patches if n == "a"]
        if written:
            obj["status"] = written[-1]
        return written[-1] if written else None

    first = await round_with({"id": "team-a.a", "phase": "Running", "step": 3})
    assert first is not None and (first["phase"], first["step"]) == ("Running", 3)
    assert await round_with({"id": "team-a.a", "phase": "Running", "step": 4}) is None
    assert obj["status"]["step"] == 3  # held back, not lost: a later write carries it
    done = {"id": "team-a.a", "phase": "Succeeded", "step": 40, "adapterPath": "/ckpt/x"}
    last = await round_with(done)
    assert last is not None and (last["phase"], last["step"]) == ("Succeeded", 40)


async def test_pool_deleted_sends_its_experiments_back_to_pending() -> None:
    running = experiment("a").status(phase="Running", engine="e1").obj()
    done = experiment("b").status(phase="Succeeded", engine="e1").obj()
    other = experiment("c").pool("pool-b").status(phase="Running", engine="x").obj()
    r, _, events = _reconciler(FakeEngines())
    r.kube = kube = FakeKube([running, done, other])  # type: ignore[assignment]
    await r.pool_deleted("pool-a")
    assert [n for n, _ in kube.patches] == ["a"]
    s = _status(kube)
    assert s["phase"] == "Pending" and s["engine"] is None
    assert "spec.enginePool" in s["message"]
    assert [e[2] for e in events] == ["AdmissionFailed"]


async def test_engine_that_stops_answering_after_its_pod_was_deleted_is_draining() -> None:
    # The pod list showed it running; the engine then got SIGTERM (pod deleted) and
    # stopped answering: a fresh read of the pod tells draining from lost.
    stamp = "2030-01-01T00:01:00Z"
    deleted = {"metadata": {"name": "e1", "deletionTimestamp": stamp}, "status": {}}
    r, _, _ = _reconciler(FakeEngines())
    r.kube = FakeKube([deleted])  # type: ignore[assignment]
    view = EngineView(name="e1", url="http://e1", pod_ready=True, pod_phase="Running")
    await r._probe(view, "token", "loraplex-system")
    assert not view.reachable and view.terminating
    assert view.deleting_until == parse_time(stamp)

    r.kube = FakeKube([])  # type: ignore[assignment]
    crashed = EngineView(name="e2", url="http://e2", pod_ready=True, pod_phase="Running")
    await r._probe(crashed, "token", "loraplex-system")
    assert not crashed.reachable and not crashed.terminating


def _experiment_series(pool: str) -> dict[tuple[str, str], float]:
    from loraplex_operator import metrics as m

    out = {}
    for family in m.REGISTRY.collect():
        for s in family.samples:
            if s.name.startswith("loraplex_experiment_") and s.labels.get("pool") == pool:
                out[(s.name, s.labels.get("phase", ""))] = s.value
    return out


async def test_round_exports_the_derived_status_and_drops_deleted_experiments() -> None:
    from loraplex_operator import metrics as m

    obj = experiment("a").algorithm(maxSteps=40).status(restarts=2, step=4).obj()
    running = {"id": "team-a.a", "phase": "Running", "step": 9}
    r, _, _ = _reconciler(FakeEngines(put=(201, running)))
    snap, plan = _round(obj, puts=[_put(obj)])
    plan.work["team-a/a"].restarts = 2
    try:
        await r.act(snap, plan, "token")
        assert _experiment_series("pool-a") == {
            ("loraplex_experiment_phase", "Running"): 1,
            ("loraplex_experiment_restarts", ""): 2,
            ("loraplex_experiment_step", ""): 9,
            ("loraplex_experiment_max_steps", ""): 40,
        }
        labels = {
            "namespace": "team-a",
            "experiment": "team-a.a",
            "pool": "pool-a",
            "phase": "Running",
            "reason": "Training",
        }
        assert m.REGISTRY.get_sample_value("loraplex_experiment_phase", labels) == 1
        assert "team-a/a" in r.publisher.last_write  # its status was written
        # Deleted (or being deleted: plan_round leaves it out of the work): series gone,
        # and the reconciler keeps nothing of it.
        snap = _snap()
        await r.act(snap, RoundPlan(work={}), "token")
        assert _experiment_series("pool-a") == {}
        assert "team-a/a" not in r.publisher.last_write
    finally:
        m.forget_pool("pool-a")


async def test_a_round_reading_a_stale_experiment_does_not_undo_a_recoverys_restart() -> None:
    # Round 1 recovers `a` (restarts 0 -> 1) and binds it to e2. Round 2, woken at once by
    # the lost engine's Pod turning Failed, still reads the object from before that write
    # (restarts 0, engine e1) and adopts `a` on e2: its write must keep restarts at 1.
    stale = experiment("a").status(phase="Running", engine="e1", restarts=0).obj()
    kube, events = FakeKube(), []
    config = Config(status_interval=0)
    pub = StatusPublisher(kube, lambda *e: events.append(e), config)  # type: ignore[arg-type]
    recovered = Work(Experiment.from_obj(stale), restarts=1, binding=Binding("e2", "node-1"))
    recovered.engine_status = {"id": "team-a.a", "phase": "Running", "step": 3}
    await pub.publish(recovered, NOW)
    adopted = Work.start(Experiment.from_obj(stale))  # the stale read: restarts 0
    adopted.binding, adopted.engine_status = Binding("e2", "node-1"), {"phase": "Running"}
    status = await pub.publish(adopted, NOW)
    assert [p["status"]["restarts"] for _, p in kube.patches] == [1, 1]
    assert status.restarts == 1 and status.engine == "e2"
    # Another object of the same name (a new uid) starts from its own count.
    fresh = experiment("a").set("metadata.uid", "uid-new").obj()
    assert (await pub.publish(Work.start(Experiment.from_obj(fresh)), NOW)).restarts == 0


class _Deletes(FakeEngines):
    def __init__(self, final: dict[str, Any]) -> None:
        super().__init__(delete=final)
        self.deleted = 0

    async def delete(self, *args: Any) -> dict[str, Any] | None:
        self.deleted += 1
        return await super().delete(*args)


async def test_an_idle_client_experiment_is_suspended_before_its_unload() -> None:
    """The idle TTL (idle.py): spec.suspend and the mark are written first, then the
    engine checkpoints and unloads it; its status says why and how it resumes. A patch
    that fails leaves it loaded (tried again next round)."""
    from loraplex_operator import idle
    from loraplex_operator.kube import KubeError
    from loraplex_operator.round_plan import IDLE

    obj = experiment("a").client(idleSeconds=60).status(phase="Running", engine="e1").obj()
    final = {"id": "team-a.a", "phase": "Running", "step": 5, "idleSeconds": 61.0}
    final["checkpoint"] = {"path": "tinker://m/weights/step-00000005", "step": 5}
    engines = _Deletes(final)
    r, kube, events = _reconciler(engines)
    unload = Unload("e1", "http://e1", "team-a.a", "team-a/a", IDLE)
    snap, plan = _round(obj, unloads=[unload])
    await r.act(snap, plan, "token")
    spec_patch = kube.patches[0][1]
    assert spec_patch["spec"] == {"suspend": True}
    assert idle.IDLE_ANNOTATION in spec_patch["metadata"]["annotations"]
    assert engines.deleted == 1
    s = next(p["status"] for _, p in kube.patches if "status" in p)
    assert s["phase"] == "Suspended" and s["checkpoint"]["step"] == 5 and s["engine"] is None
    assert "next call" in s["message"]
    assert events[0][2] == "Suspended" and "idleSeconds" in events[0][3]

    class Refusing(FakeKube):
        async def patch(self, res: Any, name: str, patch: dict[str, Any], *a: Any, **kw: Any):
            if "spec" in patch:
                raise KubeError(409, "conflict")
            return await super().patch(res, name, patch, **kw)

    engines = _Deletes(final)
    r, _, _ = _reconciler(engines)
    r.kube = Refusing()  # type: ignore[assignment]
    snap, plan = _round(obj, unloads=[unload])
    await r.act(snap, plan, "token")
    assert engines.deleted == 0
