"""The operator end to end: the real operator process, a Kubernetes API (kmock, or a real
cluster under `make e2e`), and real engine processes on the tiny model.

Every scenario asserts outcomes (phases, steps, checkpoints, Events, engine contents),
never call counts: kmock may deliver a create twice, and rounds are level-based.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from loraplex_operator.kube import POOLS, SECRETS, KubeError

from tests.support.harness import ENGINE_NS, TOKEN_SECRET, Harness
from tests.support.kubelet import PodEngine
from tests.support.measurements import record_seconds

pytestmark = pytest.mark.slow

NS = "team-a"
# The tiny model trains a step in tens of milliseconds, so scenarios that must catch an
# experiment mid-run (kill, preempt, restart, suspend) use long runs with sparse
# checkpoints; LORAPLEX_E2E_STEPS scales them (a slower engine needs fewer).
LONG = int(os.environ.get("LORAPLEX_E2E_STEPS", "200"))
EVERY = max(LONG // 15, 2)
MEASURE_FILE = Path(os.environ.get("LORAPLEX_MEASURE_FILE", "out/operator-measurements.json"))


def _record(name: str, seconds: float) -> None:
    record_seconds(MEASURE_FILE, name, seconds)


@pytest.fixture
async def h(tmp_path: Path, tiny_model_dir: Path):
    async with Harness.create(tmp_path, tiny_model_dir) as harness:
        yield harness


async def _token(h: Harness) -> str:
    return await h.kube.secret_value(ENGINE_NS, TOKEN_SECRET, "token")  # type: ignore[union-attr]


async def _engine_experiments(h: Harness, pod: dict[str, Any]) -> list[str]:
    from loraplex_operator.manifests import engine_url

    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.get(
            f"{engine_url(pod)}/v1/experiments",
            headers={"Authorization": f"Bearer {await _token(h)}"},
        )
        r.raise_for_status()
        return [e["id"] for e in r.json()["experiments"]]


async def _checkpoint_now(h: Harness, pod: dict[str, Any], exp_id: str) -> dict[str, Any]:
    from loraplex_operator.manifests import engine_url

    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(
            f"{engine_url(pod)}/v1/experiments/{exp_id}/checkpoint",
            headers={"Authorization": f"Bearer {await _token(h)}"},
        )
        r.raise_for_status()
        return r.json()


async def _ready_engines(h: Harness, pool: str, n: int) -> list[dict[str, Any]]:
    async def ready() -> list[dict[str, Any]] | None:
        pods = [p for p in await h.engine_pods(pool) if p.get("status", {}).get("podIP")]
        return pods if len(pods) == n else None

    return await h.wait_for(f"{n} ready engines in {pool}", ready, timeout=180)


async def _bound_and_first_step(
    h: Harness, name: str, t0: float, timeout: float = 180.0
) -> tuple[float, float]:
    """Seconds from t0 (just before the apply) until status shows the engine, and step >= 1."""
    bound: float | None = None

    async def stepped() -> bool:
        nonlocal bound
        s = await h.status(NS, name)
        if bound is None and s.get("engine"):
            bound = time.monotonic() - t0
        return s.get("step", 0) >= 1

    await h.wait_for(f"{name} step >= 1", stepped, timeout, interval=0.05)
    first = time.monotonic() - t0
    return (bound if bound is not None else first), first


async def _experiment_samples(h: Harness, **labels: str) -> list[Any]:
    """The operator's loraplex_experiment_* samples whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    assert h.operator is not None
    async with httpx.AsyncClient(timeout=30) as c:
        text = (await c.get(h.operator.metrics_url)).text
    return [
        s
        for family in text_string_to_metric_families(text)
        if family.name.startswith("loraplex_experiment_")
        for s in family.samples
        if labels.items() <= s.labels.items()
    ]


async def _reasons(h: Harness, name: str) -> list[str]:
    return [e.get("reason") for e in await h.events(NS, name)]


async def _messages(h: Harness, name: str, reason: str) -> list[str]:
    return [e.get("message", "") for e in await h.events(NS, name) if e.get("reason") == reason]


async def _event(h: Harness, name: str, reason: str, contains: str = "") -> str:
    """Wait for an Event (kopf posts them asynchronously) and return its message."""

    async def found() -> str | None:
        return next((m for m in await _messages(h, name, reason) if contains in m), None)

    return await h.wait_for(f"{reason} event on {name} with {contains!r}", found, timeout=30)


# --- scenarios -------------------------------------------------------------------------


async def test_six_experiments_pack_onto_two_engines_and_succeed(h: Harness) -> None:
    await h.apply(h.pool_obj("pool-a", slots=4, replicas=(0, 2)))
    names = [f"pack{i}" for i in range(6)]
    t0 = time.monotonic()
    for i, name in enumerate(names):
        await h.apply(h.experiment_obj(name, "pool-a", max_steps=8, every=4, seed=i))

    max_pods, max_per_engine = 0, 0
    first_step: float | None = None

    async def all_done() -> bool:
        nonlocal max_pods, max_per_engine, first_step
        pods = await h.engine_pods("pool-a")
        max_pods = max(max_pods, len(pods))
        statuses = [await h.status(NS, n) for n in names]
        per_engine: dict[str, int] = {}
        for s in statuses:
            if s.get("phase") in ("Scheduled", "Running") and s.get("engine"):
                per_engine[s["engine"]] = per_engine.get(s["engine"], 0) + 1
        max_per_engine = max([max_per_engine, *per_engine.values()])
        if first_step is None and any(s.get("step", 0) >= 1 for s in statuses):
            first_step = time.monotonic() - t0
        return all(s.get("phase") == "Succeeded" for s in statuses)

    await h.wait_for("six experiments Succeeded", all_done, timeout=400, interval=0.2)
    assert max_pods == 2, f"scaled to {max_pods} engines"
    assert max_per_engine <= 4
    for name in names:
        s = await h.status(NS, name)
        assert s["engine"].startswith("pool-a-engine-")
        assert s["step"] == 8 and isinstance(s["reward"], float)
        assert s["adapterPath"] and s["checkpoint"]["step"] == 8
        if not h.real_cluster:
            assert (Path(s["adapterPath"]) / "adapter_config.json").exists()
        assert s["restarts"] == 0
    assert first_step is not None
    _record("cold_pool_apply_to_first_step_s", first_step)
    if h.kubelet is not None and h.kubelet.start_seconds:
        _record("cold_pool_engine_process_start_s", max(h.kubelet.start_seconds.values()))

    # Idle engines above replicas.min (0) are removed.
    async def scaled_down() -> bool:
        return not await h.engine_pods("pool-a")

    await h.wait_for("scale-down to 0 engines", scaled_down, timeout=60)


async def test_engine_killed_mid_training_resumes_on_another_engine(h: Harness) -> None:
    await h.apply(h.pool_obj("pool-k", slots=4, replicas=(2, 2)))
    await _ready_engines(h, "pool-k", 2)
    every = EVERY
    names = ["kill0", "kill1", "kill2"]
    for i, name in enumerate(names):
        await h.apply(h.experiment_obj(name, "pool-k", max_steps=LONG, every=every, seed=i))

    async def checkpointed() -> bool:
        ss = [await h.status(NS, n) for n in names]
        return all(
            s.get("phase") == "Running" and (s.get("checkpoint") or {}).get("step") for s in ss
        )

    await h.wait_for("all running with a checkpoint", checkpointed, timeout=240)
    before = {n: await h.status(NS, n) for n in names}
    victim = before[names[0]]["engine"]
    on_victim = [n for n in names if before[n]["engine"] == victim]
    await h.kill_engine(victim)
    killed_at = {}
    for n in on_victim:  # the last step the status showed before the recovery
        s = await h.status(NS, n)
        killed_at[n] = s["step"] if not s.get("restarts") else before[n]["step"]

    lowest: dict[str, int] = {n: 10**9 for n in on_victim}

    async def moved() -> bool:
        ok = True
        for n in on_victim:
            s = await h.status(NS, n)
            if s.get("restarts", 0) >= 1 and s.get("engine") not in (None, victim):
                lowest[n] = min(lowest[n], s.get("step", 10**9))
            else:
                ok = False
        return ok

    await h.wait_for("experiments moved to another engine", moved, timeout=180, interval=0.1)
    for n in on_victim:
        print(f"recovery {n}: step {killed_at[n]} at the kill, {lowest[n]} after, every {every}")
        assert lowest[n] >= killed_at[n] - every, (n, killed_at[n], lowest[n])
        await _event(h, n, "EngineLost", victim)
        await _event(h, n, "Bound", "resumed from step")
    for n in names:
        s = await h.wait_phase(NS, n, "Succeeded", timeout=300)
        assert s["step"] == LONG
        assert s["restarts"] == (1 if n in on_victim else 0)
    if h.operator is not None:  # the operator's per-experiment series say the same
        want = {(f"{NS}.{n}", 1 if n in on_victim else 0, "Succeeded") for n in names}

        async def exported() -> bool:
            samples = await _experiment_samples(h, pool="pool-k")
            restarts = {
                s.labels["experiment"]: s.value
                for s in samples
                if s.name == "loraplex_experiment_restarts"
            }
            phases = {
                s.labels["experiment"]: s.labels["phase"]
                for s in samples
                if s.name == "loraplex_experiment_phase"
            }
            return {(e, restarts.get(e), phases.get(e)) for e in phases} == want

        await h.wait_for("restarts and phases in the operator's /metrics", exported, timeout=60)


async def test_engine_stopped_gracefully_resumes_from_its_sigterm_checkpoint(h: Harness) -> None:
    await h.apply(h.pool_obj("pool-g", slots=4, replicas=(2, 2)))
    pods = await _ready_engines(h, "pool-g", 2)
    # No periodic checkpoint before the last step: the only ones are the one taken below,
    # which status records, and the one the engine writes on SIGTERM. Far more steps than
    # the test waits for, so the SIGTERM always lands mid-run: with LONG steps a quiet
    # machine finished the run during the drain, and then there was nothing to checkpoint.
    steps = 50 * LONG
    await h.apply(h.experiment_obj("drain", "pool-g", max_steps=steps, every=steps))

    async def training() -> dict[str, Any] | None:
        s = await h.status(NS, "drain")
        return s if s.get("phase") == "Running" and s.get("step", 0) >= 1 else None

    victim = (await h.wait_for("drain training", training, timeout=120))["engine"]
    pod = next(p for p in pods if p["metadata"]["name"] == victim)
    requested = (await _checkpoint_now(h, pod, "team-a.drain"))["step"]

    async def past_recorded_checkpoint() -> dict[str, Any] | None:
        s = await h.status(NS, "drain")
        recorded = (s.get("checkpoint") or {}).get("step") == requested
        return s if recorded and s.get("step", 0) > requested else None

    seen = (await h.wait_for("status past its checkpoint", past_recorded_checkpoint))["step"]
    engine = h.kubelet.processes.get(victim) if h.kubelet is not None else None
    await h.stop_engine(victim)

    async def moved() -> dict[str, Any] | None:
        s = await h.status(NS, "drain")
        return s if s.get("restarts") == 1 and s.get("engine") not in (None, victim) else None

    s = await h.wait_for("drain resumed on another engine", moved, timeout=180, interval=0.1)
    resumed = s["checkpoint"]["step"]
    print(f"graceful stop: status checkpoint {requested}, step {seen} seen, resumed at {resumed}")
    assert resumed >= seen > requested, (requested, seen, resumed)  # the SIGTERM checkpoint
    uid = (await h.get(NS, "drain") or {})["metadata"]["uid"]  # the run: the object's uid
    assert s["checkpoint"]["path"].endswith(f"/drain/{uid}/step-{resumed:08d}")
    await _event(h, "drain", "Bound", f"resumed from step {resumed}, requested step {requested}")
    if isinstance(engine, PodEngine):
        # The engine logs the line just after renaming the checkpoint into place, so the
        # operator can see the checkpoint before the line is written: wait for it.
        line = f"shutdown checkpoint team-a.drain at step {resumed}:"

        async def logged() -> bool:
            return line in engine.log_text()

        await h.wait_for("the engine's shutdown checkpoint log line", logged, timeout=30)

    async def training_again() -> dict[str, Any] | None:
        s = await h.status(NS, "drain")
        return s if s.get("phase") == "Running" and s.get("step", 0) > resumed + 2 else None

    s = await h.wait_for("drain training on its new engine", training_again, timeout=120)
    assert s["restarts"] == 1 and s["engine"] != victim


async def test_high_priority_preempts_low_which_resumes_and_finishes(h: Harness) -> None:
    high_class = [{"name": "high", "value": 10}]
    await h.apply(h.pool_obj("pool-p", slots=2, replicas=(0, 1), priority_classes=high_class))
    lows = ["low0", "low1"]
    for i, n in enumerate(lows):  # no class: value 0
        await h.apply(h.experiment_obj(n, "pool-p", max_steps=LONG, every=EVERY, seed=i))

    async def lows_running() -> bool:
        return all([(await h.status(NS, n)).get("checkpoint") for n in lows])

    await h.wait_for("low-priority experiments training", lows_running, timeout=240)
    last_step = {n: 0 for n in lows}  # the furthest step status showed while training

    async def one_pending() -> tuple[str, dict[str, Any]] | None:
        for n in lows:
            s = await h.status(NS, n)
            if s.get("phase") == "Running":
                last_step[n] = max(last_step[n], s.get("step", 0))
            elif s.get("phase") == "Pending":
                return n, s
        return None

    await h.apply(h.experiment_obj("high", "pool-p", max_steps=8, every=4, priority_class="high"))
    # The victim waits in Pending while "high" trains (a second or so): poll fast.
    victim, pending = await h.wait_for(
        "a low-priority experiment back to Pending", one_pending, 120, interval=0.05
    )
    await _event(h, victim, "Preempted", "team-a/high")
    # Checkpointed at the preemption itself (the engine's unload), not an older periodic
    # checkpoint: it holds the step training stopped at, no earlier than status ever showed.
    ckpt = pending.get("checkpoint") or {}
    print(f"preempted {victim}: last seen at step {last_step[victim]}, pending with {ckpt}")
    assert not pending.get("engine") and ckpt.get("step") == pending["step"], pending
    assert ckpt["step"] >= last_step[victim] and ckpt["path"].endswith(f"step-{ckpt['step']:08d}")
    high = await h.wait_phase(NS, "high", "Succeeded", timeout=240)
    assert high["step"] == 8
    s = await h.wait_phase(NS, victim, "Succeeded", timeout=300)
    assert s["step"] == LONG and s["restarts"] == 0
    resumed = await _event(h, victim, "Bound", ckpt["path"])  # from the preemption's checkpoint
    assert f"resumed from step {ckpt['step']}" in resumed
    other = next(n for n in lows if n != victim)
    await h.wait_phase(NS, other, "Succeeded", timeout=120)
    if h.operator is not None:
        async with httpx.AsyncClient() as c:
            metrics = (await c.get(h.operator.metrics_url)).text
        assert 'loraplex_preemptions_total{pool="pool-p"} 1.0' in metrics


_LOW_CLASS = [{"name": "low", "value": -1}]


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), {})


async def test_a_tenants_class_preempts_another_namespace_only_when_the_admin_allows(
    h: Harness,
) -> None:
    """team-a's "high" class outranks team-b's default-class experiment on a full pool, but
    unloads it only once the pool's admin sets preemptOtherNamespaces on the class."""
    high = {"name": "high", "value": 100, "namespaces": [NS]}
    await h.apply(h.pool_obj("pool-t", slots=1, replicas=(0, 1), priority_classes=[high]))
    await h.apply(h.experiment_obj("b-run", "pool-t", max_steps=0, every=EVERY, namespace="team-b"))

    async def b_training() -> dict[str, Any] | None:
        s = await h.status("team-b", "b-run")
        return s if s.get("phase") == "Running" and s.get("step", 0) > 0 else None

    await h.wait_for("team-b's experiment training", b_training, timeout=240)
    await h.apply(h.experiment_obj("a-high", "pool-t", max_steps=4, every=2, priority_class="high"))
    # team-b may not name team-a's class: not placed, and told which class and namespace.
    await h.apply(h.experiment_obj("b-high", "pool-t", namespace="team-b", priority_class="high"))

    async def a_waits() -> dict[str, Any] | None:
        s = await h.status(NS, "a-high")
        return s if _condition(s, "Scheduled").get("reason") == "NoCapacity" else None

    await h.wait_for("team-a's experiment waiting for room", a_waits, timeout=60)
    refused = await h.wait_phase("team-b", "b-high", "Pending", timeout=60)
    admitted = _condition(refused, "Admitted")
    assert admitted["status"] == "False", refused
    assert "namespace 'team-b' may not use priority class 'high'" in admitted["message"]
    before = (await h.status("team-b", "b-run"))["step"]
    await asyncio.sleep(5)  # five rounds (LORAPLEX_RECONCILE_INTERVAL=1): still not preempted
    s = await h.status("team-b", "b-run")
    assert s["phase"] == "Running" and s["step"] > before and s["restarts"] == 0, s
    assert "Preempted" not in [e.get("reason") for e in await h.events("team-b", "b-run")]
    assert (await h.status(NS, "a-high"))["phase"] == "Pending"

    allowed = [{**high, "preemptOtherNamespaces": True}]
    await h.kube.patch(POOLS, "pool-t", {"spec": {"priorityClasses": allowed}})  # type: ignore[union-attr]
    assert (await h.wait_phase(NS, "a-high", "Succeeded", timeout=240))["step"] == 4

    async def b_preempted() -> str | None:
        events = await h.events("team-b", "b-run")
        return next((e["message"] for e in events if e.get("reason") == "Preempted"), None)

    assert f"{NS}/a-high" in await h.wait_for("team-b's experiment preempted", b_preempted, 30)
    resumed = await h.wait_for("team-b's experiment training again", b_training, timeout=120)
    assert resumed["step"] >= before


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class BindingWatch:
    """Polls every engine's GET /v1/experiments (all engines at once, so each poll is one
    snapshot) and remembers any experiment held by two engines at the same time."""

    def __init__(self, h: Harness, pods: list[dict[str, Any]]) -> None:
        self.h, self.pods = h, pods
        self.polls = 0
        self.seen: set[str] = set()
        self.doubles: list[dict[str, list[str]]] = []
        self._task: asyncio.Task[None] | None = None

    async def _snapshot(self, c: httpx.AsyncClient, token: str) -> dict[str, list[str]]:
        from loraplex_operator.manifests import engine_url

        async def ids(pod: dict[str, Any]) -> list[str]:
            r = await c.get(f"{engine_url(pod)}/v1/experiments", headers=_bearer(token))
            r.raise_for_status()
            return [e["id"] for e in r.json()["experiments"]]

        held = await asyncio.gather(*(ids(p) for p in self.pods))
        holders: dict[str, list[str]] = {}
        for pod, exp_ids in zip(self.pods, held, strict=True):
            for exp_id in exp_ids:
                holders.setdefault(exp_id, []).append(pod["metadata"]["name"])
        return holders

    async def _run(self) -> None:
        token = await _token(self.h)
        async with httpx.AsyncClient(timeout=30) as c:
            while True:
                holders = await self._snapshot(c, token)
                self.polls += 1
                self.seen |= holders.keys()
                if any(len(engines) > 1 for engines in holders.values()):
                    self.doubles.append(holders)
                await asyncio.sleep(0.1)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def check(self) -> None:
        """Raise what the poller ran into, and any double binding, as soon as seen."""
        assert self._task is not None
        if self._task.done():
            self._task.result()
        assert not self.doubles, f"bound on two engines at once: {self.doubles[0]}"

    async def stop(self) -> None:
        assert self._task is not None
        self.check()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def test_operator_restarted_mid_flight_binds_nothing_twice_loses_nothing(
    h: Harness,
) -> None:
    # Two engines with room for everything: a second operator that forgot a binding (or
    # never saw its status) could put the same experiment on the other engine.
    await h.apply(h.pool_obj("pool-r", slots=4, replicas=(2, 2)))
    watch = BindingWatch(h, await _ready_engines(h, "pool-r", 2))
    watch.start()
    names = ["r0", "r1", "r2", "r3"]
    for i, n in enumerate(names[:2]):
        await h.apply(h.experiment_obj(n, "pool-r", max_steps=LONG, every=EVERY, seed=i))

    async def first_loaded() -> bool:
        watch.check()
        return bool(watch.seen)

    # Killed as soon as an engine holds one: the other may be mid-bind, and the loaded
    # one's status may not be written yet.
    await h.wait_for("first experiment on an engine", first_loaded, timeout=240, interval=0.05)
    assert h.operator is not None
    await asyncio.to_thread(h.operator.kill)  # SIGKILL: no cleanup code runs
    at_kill, t_kill = len(watch.seen), time.monotonic()
    # Two more arrive while no operator runs: the new one binds them next to what the old
    # one left on the engines, which it must adopt rather than bind again.
    for i, n in enumerate(names[2:], start=2):
        await h.apply(h.experiment_obj(n, "pool-r", max_steps=LONG, every=EVERY, seed=i))
    h.operator.start()

    async def all_succeeded() -> bool:
        watch.check()
        phases = [(await h.status(NS, n)).get("phase") for n in names]
        return all(p == "Succeeded" for p in phases)

    await h.wait_for("all Succeeded after the restart", all_succeeded, timeout=300)
    await watch.stop()
    print(
        f"restart: {at_kill} of 2 on an engine at the kill, all {len(names)} Succeeded "
        f"{time.monotonic() - t_kill:.1f}s later; {watch.polls} engine snapshots, no double"
    )
    assert watch.seen == {f"{NS}.{n}" for n in names}  # each was watched on an engine
    for n in names:
        s = await h.status(NS, n)
        assert s["step"] == LONG and s["restarts"] == 0
        bound = await _messages(h, n, "Bound")
        assert len(bound) <= 1, (n, bound)
    assert h.operator.starts == 2


async def test_invalid_experiments_are_rejected_naming_the_field(h: Harness) -> None:
    await h.apply(h.pool_obj("pool-v", slots=2, max_rank=8, replicas=(0, 1)))
    await h.apply(h.experiment_obj("too-big", "pool-v", rank=16))
    await h.apply(h.experiment_obj("no-pool", "missing-pool"))

    async def rejected(name: str, field: str) -> None:
        async def check() -> bool:
            s = await h.status(NS, name)
            conds = {c["type"]: c for c in s.get("conditions", [])}
            adm = conds.get("Admitted", {})
            return adm.get("status") == "False" and field in adm.get("message", "")

        await h.wait_for(f"{name} rejected on {field}", check, timeout=60)
        s = await h.status(NS, name)
        assert s["phase"] == "Pending" and not s.get("engine")

        await _event(h, name, "AdmissionFailed", field)

    await rejected("too-big", "spec.lora.rank")
    await rejected("no-pool", "spec.enginePool")
    assert not await h.engine_pods("pool-v")  # nothing was scaled up for them
    if not h.real_cluster:  # the schema/CEL layer answers 422 before the operator sees it
        bad = h.experiment_obj("bad-alpha", "pool-v", rank=1)
        bad["spec"]["lora"]["alpha"] = 64
        with pytest.raises(Exception, match="alpha"):
            await h.apply(bad)


async def test_delete_unloads_and_keeps_checkpoint_suspend_resumes(h: Harness) -> None:
    await h.apply(h.pool_obj("pool-d", slots=4, replicas=(1, 1), priority_classes=_LOW_CLASS))

    async def engine_ready() -> dict[str, Any] | None:
        pods = await h.engine_pods("pool-d")
        return next((p for p in pods if p.get("status", {}).get("podIP")), None)

    await h.wait_for("engine ready", engine_ready, timeout=180)
    t0 = time.monotonic()
    await h.apply(h.experiment_obj("del", "pool-d", max_steps=0, every=EVERY))
    bound, first = await _bound_and_first_step(h, "del", t0)
    _record("warm_engine_apply_to_bound_s", bound)
    _record("warm_engine_apply_to_first_step_s", first)
    await h.apply(h.experiment_obj("sus", "pool-d", max_steps=LONG, every=EVERY, seed=3))
    await h.apply(h.experiment_obj("stay", "pool-d", max_steps=0, every=EVERY, seed=4))

    async def checkpointed(name: str) -> dict[str, Any] | None:
        s = await h.status(NS, name)
        return s if (s.get("checkpoint") or {}).get("step") else None

    await h.wait_for("del checkpointed", lambda: checkpointed("del"), timeout=120)
    pod = await engine_ready()
    assert pod is not None and "team-a.del" in await _engine_experiments(h, pod)
    uid = (await h.get(NS, "del") or {})["metadata"]["uid"]

    await h.delete(NS, "del")

    async def gone() -> bool:
        return await h.get(NS, "del") is None

    await h.wait_for("del deleted (finalizer released)", gone, timeout=60)
    assert "team-a.del" not in await _engine_experiments(h, pod)
    if h.operator is not None:  # no stale series of a deleted experiment
        assert await _experiment_samples(h, experiment="team-a.stay")

        async def series_gone() -> bool:
            return not await _experiment_samples(h, experiment="team-a.del")

        await h.wait_for("del's series gone from the operator's /metrics", series_gone, 60)
    if not h.real_cluster:
        # kept in the run's own directory, which a new "del" (another uid) never touches
        ckpt = h.checkpoint_dir(pod["metadata"]["name"])
        assert list((ckpt / NS / "del" / uid).glob("step-*/adapter_config.json"))

    # suspend: checkpoint + unload, slot freed; unsuspend: resume from the checkpoint
    await h.wait_for("sus checkpointed", lambda: checkpointed("sus"), timeout=120)
    await h.patch_spec(NS, "sus", {"suspend": True})
    s = await h.wait_phase(NS, "sus", "Suspended", timeout=60)
    assert not s.get("engine") and s["checkpoint"]["step"] >= EVERY
    assert "team-a.sus" not in await _engine_experiments(h, pod)
    await h.patch_spec(NS, "sus", {"suspend": False})
    s = await h.wait_phase(NS, "sus", "Succeeded", timeout=240)
    assert s["step"] == LONG
    await _event(h, "sus", "Bound", "resumed from step")

    # Editing what defines a running run is refused at apply time (CEL transition rule,
    # evaluated by the real API server or, on kmock, by the harness with crdkit) and the
    # run goes on unchanged; its priority class stays editable.
    assert (await h.status(NS, "stay")).get("engine")
    with pytest.raises(KubeError, match=r"spec\.lora is immutable once created"):
        await h.patch_spec(NS, "stay", {"lora": {"rank": 8}})
    await h.patch_spec(NS, "stay", {"priorityClassName": "low"})
    stay = await h.get(NS, "stay")
    assert stay is not None
    assert (stay["spec"]["lora"]["rank"], stay["spec"]["priorityClassName"]) == (4, "low")
    assert "team-a.stay" in await _engine_experiments(h, pod)

    # Deleting the pool (its engines go with it) sends what it ran back to Pending.
    assert (await h.status(NS, "stay")).get("engine")
    await h.kube.delete(POOLS, "pool-d")  # type: ignore[union-attr]

    async def orphaned() -> bool:
        s = await h.status(NS, "stay")
        adm = next((c for c in s.get("conditions", []) if c["type"] == "Admitted"), {})
        return s.get("phase") == "Pending" and "spec.enginePool" in adm.get("message", "")

    await h.wait_for("stay pending after its pool was deleted", orphaned, timeout=60)
    assert not (await h.status(NS, "stay")).get("engine")
    if h.operator is not None:  # the pool's per-experiment series went with it
        assert not await _experiment_samples(h, pool="pool-d")
    assert await h.kube.get(SECRETS, TOKEN_SECRET, ENGINE_NS)  # type: ignore[union-attr]
