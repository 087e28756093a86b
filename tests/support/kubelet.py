"""The test "kubelet": runs every engine Pod of the emulator as a local process and
reports its status, as a node would.

Each engine Pod's container runs as the operator wrote it (`pod_runtime`: its command,
args and env; its volumes as local directories, the Secret volume as a file; the model
path of the image as the local model). The engine binds a free port, which the kubelet
publishes as the Pod's `loraplex.dev/engine-url` annotation with `podIP` 127.0.0.1.
Deleting a Pod that runs is graceful (see `harness.ApiServer`): SIGTERM, wait for the
exit (the engine checkpoints first), then let the API server remove the Pod.

A container whose process exits is restarted in its Pod as the Pod's `restartPolicy`
says (the engine Pod's is Always; OnFailure restarts a non-zero exit; Never does not),
the way a kubelet does: whatever the container still ran is killed with it, the Pod stays
`Running` but not Ready while the new container starts (its `restartCount` counted in
`containerStatuses`), after the kubelet's back-off (none before the first restart, then
10 s doubling to 300 s), with the same volumes (an emptyDir outlives its container). Its
engine binds a new port, so `loraplex.dev/engine-url` changes where a real Pod's IP would
not. A container that exits while it starts is restarted the same way
(`CrashLoopBackOff` while it waits). The states a kubelet writes for what goes wrong
(`kubelet_status.py`): an image the node's registry lacks (`Node.images`: ErrImagePull,
ImagePullBackOff), env from a missing Secret (CreateContainerConfigError), a container
over its memory limit (SIGKILLed: OOMKilled), a nodeSelector the node's labels do not
match (Unschedulable), a GPU the device plugin reports unhealthy (`Node.unhealthy`: the
Pod Failed, UnexpectedAdmissionError). With `probe_readiness` it probes each engine's
readiness as the Pod's readinessProbe says. A container that is not restarted turns its
Pod `Failed`; so does `Kubelet.kill` (a node loss: nothing on the node restarts it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import kmock
import psutil
from loraplex_operator import manifests
from loraplex_operator.kube import PODS, Kube

from tests.support import kubelet_status as ks
from tests.support.pod_runtime import (
    ContainerConfigError,
    Node,
    PodSpecError,
    SecretReader,
    container_env,
    local_command,
    local_env,
)
from tests.support.server_process import EngineServer

NODE = "kmock-node"
# The kubelet's crash back-off: the first restart at once, then 10 s doubling to 300 s.
BACKOFF_S, MAX_BACKOFF_S = 10.0, 300.0
# Holds a deleted Pod while its engine shuts down (a real API server does this natively).
KUBELET_HOLD = "kmock.loraplex.dev/kubelet"


now = ks.now


class PodEngine(EngineServer):
    """An engine Pod's container as a process: `EngineServer`'s start (it waits for the
    listening and ready lines and /readyz), stop and kill, on the Pod's command line."""

    def __init__(
        self, pod: Mapping[str, Any], node: Node, read_secret: SecretReader | None
    ) -> None:
        meta = pod["metadata"]
        container = next(c for c in pod["spec"]["containers"] if c["name"] == manifests.CONTAINER)
        env = container_env(pod, container, read_secret)  # CreateContainerConfigError first
        self.volumes = node.volume_dirs(pod, read_secret)  # volume name -> local directory
        mapped = node.path_map(container, self.volumes)
        self.argv = local_command(container, mapped)
        self.environment = local_env(env, mapped)
        self.memory_limit = ks.memory_limit(pod)
        workdir = node.root / "pods" / meta["namespace"] / meta["name"]
        super().__init__(workdir, workdir, workdir=workdir)

    def command_line(self) -> list[str]:
        return self.argv

    def process_env(self) -> dict[str, str]:
        return self.environment

    def start(self) -> PodEngine:
        super().start()
        # It listens on every address (the Pod's default); callers reach it on loopback.
        self.url = self.url.replace("//0.0.0.0:", "//127.0.0.1:")
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss(self) -> int:
        """Resident memory of the container's processes (what a cgroup limit counts)."""
        if not self.alive() or self.proc is None:
            return 0
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
            return sum(p.memory_info().rss for p in procs)
        except psutil.Error:
            return 0


@dataclass
class Kubelet:
    """Runs an engine process per engine Pod of the emulator and reports Pod status."""

    api: kmock.KubernetesEmulator
    client: Kube
    node: Node
    processes: dict[str, PodEngine] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    start_seconds: dict[str, float] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)  # pod -> its container's restarts
    _lost: set[str] = field(default_factory=set)  # killed as in a node loss: not restarted
    _oom: set[str] = field(default_factory=set)  # killed by the memory limit, last exit
    _started_at: dict[str, str] = field(default_factory=dict)  # pod -> its container's start
    _starting_engines: dict[str, PodEngine] = field(default_factory=dict)
    _engines: dict[str, PodEngine] = field(default_factory=dict)  # pod -> its container
    _starting: set[str] = field(default_factory=set)
    _stopping: dict[str, PodEngine | None] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    # Every engine this kubelet started or is starting: close() kills them all.
    _started: list[PodEngine] = field(default_factory=list)
    _starter: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(thread_name_prefix="kubelet")
    )
    _closed: bool = False
    # Probe running engines' readiness as their readinessProbe says (periodSeconds,
    # failureThreshold, timeoutSeconds), turning the Pod not Ready and back. Off unless a
    # test asks: a loaded 2-core machine can miss a probe's timeout and flap a Pod.
    probe_readiness: bool = False
    _probes: dict[str, tuple[float, int, bool]] = field(default_factory=dict)  # next, fails, ready
    _probing: set[str] = field(default_factory=set)

    def _pods(self) -> dict[str, dict[str, Any]]:
        out = {}
        for (res, _ns, name), obj in list(self.api.objects.items()):
            if res.group == "" and res.plural == "pods" and not obj.deleted:
                raw = obj.raw
                if manifests.POOL_LABEL in (raw.get("metadata", {}).get("labels") or {}):
                    out[name] = raw
        return out

    def _secret_data(self, namespace: str, name: str) -> dict[str, str] | None:
        for (res, ns, n), obj in list(self.api.objects.items()):
            if res.plural == "secrets" and ns == namespace and n == name and not obj.deleted:
                return dict(obj.raw.get("data") or {})
        return None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(asyncio.to_thread(p.kill) for p in self._started))
        # An engine still starting sees `_closed` when its start returns, and kills itself.
        await asyncio.to_thread(self._starter.shutdown, wait=True)
        self.processes.clear()

    async def _loop(self) -> None:
        while True:
            try:
                await self._sync()
            except Exception as e:  # keep the kubelet alive; tests see the effects
                print(f"kubelet: {e!r}", file=sys.stderr)
            await asyncio.sleep(0.2)

    def _pool_exists(self, name: str) -> bool:
        for (res, _ns, n), obj in list(self.api.objects.items()):
            if res.plural == "enginepools" and n == name and not obj.deleted:
                return not obj.raw.get("metadata", {}).get("deletionTimestamp")
        return False

    async def _sync(self) -> None:
        pods = self._pods()
        for name, pod in list(pods.items()):  # the garbage collector: owner gone → pod gone
            owners = pod["metadata"].get("ownerReferences") or []
            gone = owners and not any(self._pool_exists(o["name"]) for o in owners)
            if gone and not _terminating(pod):
                await self.client.delete(PODS, name, pod["metadata"]["namespace"])
        for name, pod in pods.items():
            if _terminating(pod):
                if name not in self._starting and name not in self._stopping:
                    self._stopping[name] = self.processes.pop(name, None)
                    self._spawn(self._terminate(pod))
            elif pod.get("spec", {}).get("schedulingGates"):
                continue  # not schedulable until its gates are lifted: no node, no engine
            elif name not in self.processes and name not in self._starting | self.failed:
                self._starting.add(name)
                self._spawn(self._run_pod(pod))
        self._enforce_memory_limits()
        if self.probe_readiness:
            self._probe_readiness(pods)
        for name, proc in list(self.processes.items()):
            if name not in pods:  # removed without a grace period
                del self.processes[name]
                await asyncio.to_thread(proc.stop, 30.0)
            elif not proc.alive() and name not in self.failed:
                await self._exited(pods[name], proc)

    async def _exited(self, pod: dict[str, Any], proc: PodEngine) -> None:
        """The container's process exited: restart it in its Pod, or fail the Pod."""
        name, ns = pod["metadata"]["name"], pod["metadata"]["namespace"]
        code = proc.proc.returncode if proc.proc is not None else None
        last = self._last_state(name, proc)
        if name in self._lost or not restarts_after(pod, code):
            self.failed.add(name)
            state = {"terminated": last}
            patch = ks.pod_status("Failed", state, restarts=self.restarts.get(name, 0))
            await self._patch(ns, name, patch)
            await asyncio.to_thread(proc.kill)  # the rest of the container goes with it
            return
        del self.processes[name]
        self._starting.add(name)
        await asyncio.to_thread(proc.kill)
        self._spawn(self._run_pod(pod, proc, last=last))

    def _last_state(self, name: str, proc: PodEngine) -> dict[str, Any]:
        """The exited container's `lastState.terminated` (the kernel's SIGKILL is 137)."""
        code = proc.proc.returncode if proc.proc is not None else None
        oom = name in self._oom
        self._oom.discard(name)
        exit_code = 137 if oom or code is None or code < 0 else code
        since = self._started_at.get(name, ks.now())
        return ks.terminated(exit_code, oom, proc.log_tail(40), since)

    def _probe_readiness(self, pods: dict[str, dict[str, Any]]) -> None:
        """Start each due readiness probe of a running engine (in the background)."""
        for name, proc in list(self.processes.items()):
            due, fails, ready = self._probes.get(name, (0.0, 0, True))
            if name in pods and time.monotonic() >= due and name not in self._probing:
                self._probing.add(name)
                self._spawn(self._probe(pods[name], proc, fails, ready))

    async def _probe(self, pod: dict[str, Any], proc: PodEngine, fails: int, ready: bool) -> None:
        name, ns = pod["metadata"]["name"], pod["metadata"]["namespace"]
        container = next(c for c in pod["spec"]["containers"] if c["name"] == manifests.CONTAINER)
        probe = container.get("readinessProbe") or {}
        period, threshold = probe.get("periodSeconds", 10), probe.get("failureThreshold", 3)
        try:
            ok = await asyncio.to_thread(
                _http_ok, proc.url + "/readyz", probe.get("timeoutSeconds", 1)
            )
            fails = 0 if ok else fails + 1
            now_ready = ok or (ready and fails < threshold)
            if now_ready != ready and name in self.processes:
                state = ks.running(self._started_at.get(name, ks.now()))
                patch = ks.pod_status(
                    "Running",
                    state,
                    ready=now_ready,
                    started=True,
                    restarts=self.restarts.get(name, 0),
                    image=container.get("image", ""),
                )
                await self._patch(ns, name, patch)
            self._probes[name] = (time.monotonic() + period, fails, now_ready)
        finally:
            self._probing.discard(name)

    def _enforce_memory_limits(self) -> None:
        """A container over its memory limit is SIGKILLed (the cgroup's OOM killer)."""
        for pod, engine in [*self.processes.items(), *self._starting_engines.items()]:
            limit = engine.memory_limit
            if limit and pod not in self._oom and engine.rss() > limit:
                print(f"kubelet: pod {pod}: over its memory limit; OOM-killed", file=sys.stderr)
                self._oom.add(pod)
                engine.kill()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _terminate(self, pod: dict[str, Any]) -> None:
        """SIGTERM the engine of a deleted Pod, wait for it to exit (SIGKILL after the
        grace period), then let the API server remove the Pod."""
        name, meta = pod["metadata"]["name"], pod["metadata"]
        try:
            proc = self._stopping[name]
            if proc is not None:
                grace = float(meta.get("deletionGracePeriodSeconds", 30))
                await asyncio.to_thread(proc.stop, grace)
            held = [f for f in meta.get("finalizers") or [] if f != KUBELET_HOLD]
            patch = {"metadata": {"finalizers": held}}
            await self.client.patch(PODS, name, patch, namespace=meta["namespace"])
        except Exception as e:  # keep the kubelet alive; tests see the effects
            print(f"kubelet: stopping pod {name}: {e!r}", file=sys.stderr)
        finally:
            del self._stopping[name]

    def _start_engine(self, pod: dict[str, Any], engine: PodEngine | None) -> PodEngine:
        """A new container for `pod`; `engine`: the Pod's exited one, started again (same
        volumes; its log goes on in the next server-<n>.log)."""
        if engine is None:
            engine = PodEngine(pod, self.node, self._secret_data)
            self._started.append(engine)
            self._engines[pod["metadata"]["name"]] = engine
        self._starting_engines[pod["metadata"]["name"]] = engine
        try:
            engine.start()
        finally:
            self._starting_engines.pop(pod["metadata"]["name"], None)
            if self._closed:
                engine.kill()
        return engine

    async def _admitted(self, pod: dict[str, Any]) -> bool:
        """The scheduler and the node's admission: False when the Pod does not run here
        (left Pending unschedulable, or failed by the device manager)."""
        name, ns = pod["metadata"]["name"], pod["metadata"]["namespace"]
        if message := ks.unschedulable(pod, self.node.labels):
            await self._patch(ns, name, ks.unscheduled(message))
            return False
        if message := ks.admission_error(pod, self.node.unhealthy):
            state = ks.waiting("ContainerCreating")
            patch = ks.pod_status(
                "Failed", state, reason="UnexpectedAdmissionError", message=message
            )
            patch["spec"] = {"nodeName": NODE}
            await self._patch(ns, name, patch)
            return False
        return True

    async def _run_pod(
        self,
        pod: dict[str, Any],
        restarted: PodEngine | None = None,
        last: dict[str, Any] | None = None,
    ) -> None:
        """Start the Pod's container, as a kubelet keeps trying to: an image it cannot
        pull (ErrImagePull, ImagePullBackOff), a config it cannot make
        (CreateContainerConfigError) and a container that exits (CrashLoopBackOff, the
        crash back-off) are retried until the Pod is deleted."""
        name, ns = pod["metadata"]["name"], pod["metadata"]["namespace"]
        image = pod["spec"]["containers"][0].get("image", "")
        if restarted is None and last is None and not await self._admitted(pod):
            self.failed.add(name)
            self._starting.discard(name)
            return
        while not self._closed:
            if name not in self._pods() or _terminating(self._pods()[name]):
                self._starting.discard(name)
                return
            count = self.restarts.get(name, 0)
            phase = "Running" if last else "Pending"
            if last is not None:  # the container exited: restart it after the back-off
                count = self.restarts[name] = count + 1
                delay = crash_backoff(count)
                print(f"kubelet: pod {name}: container exited; restart {count}", file=sys.stderr)
                state = (
                    ks.waiting("CrashLoopBackOff", ks.back_off_message(pod, delay))
                    if delay
                    else ks.waiting("ContainerCreating")
                )
                status = ks.pod_status(phase, state, restarts=count, last=last, image=image)
                await self._patch(ns, name, status)
                await asyncio.sleep(delay)
            if not self.node.pulls(image):
                pulled = f'failed to pull and unpack image "{image}": not found'
                for state, pause in (
                    (ks.waiting("ErrImagePull", pulled), 1.0),
                    (ks.waiting("ImagePullBackOff", f'Back-off pulling image "{image}"'), 2.0),
                ):
                    status = ks.pod_status(phase, state, restarts=count, last=last, image=image)
                    await self._patch(ns, name, status)
                    await asyncio.sleep(pause)
                continue
            self._started_at[name] = ks.now()
            try:
                t0 = time.monotonic()
                loop = asyncio.get_running_loop()
                proc = await loop.run_in_executor(self._starter, self._start_engine, pod, restarted)
                self.start_seconds[name] = time.monotonic() - t0
            except ContainerConfigError as e:
                state = ks.waiting("CreateContainerConfigError", str(e))
                await self._patch(ns, name, ks.pod_status(phase, state, restarts=count, last=last))
                await asyncio.sleep(1.0)
                continue
            except PodSpecError as e:  # this runtime cannot run it: the test's mistake
                print(f"kubelet: pod {name} cannot run here: {e}", file=sys.stderr)
                return await self._fail(pod, {"waiting": {"reason": "RunContainerError"}})
            except Exception as e:
                engine = self._engines.get(name)
                if engine is None or engine.proc is None:
                    print(f"kubelet: engine for pod {name} failed to start: {e!r}", file=sys.stderr)
                    return await self._fail(pod, ks.waiting("RunContainerError", str(e)[-500:]))
                restarted, last = engine, self._last_state(name, engine)
                continue
            return await self._started_pod(pod, proc, last)

    async def _started_pod(
        self, pod: dict[str, Any], proc: PodEngine, last: dict[str, Any] | None
    ) -> None:
        """Its engine is up: Running and Ready, its URL published."""
        name, ns = pod["metadata"]["name"], pod["metadata"]["namespace"]
        image = pod["spec"]["containers"][0].get("image", "")
        self._starting.discard(name)
        if name not in self._pods():  # deleted while starting
            await asyncio.to_thread(proc.stop, 30.0)
            return
        self.processes[name] = proc
        count = self.restarts.get(name, 0)
        state = ks.running(self._started_at[name])
        patch = ks.pod_status("Running", state, ready=True, started=True, restarts=count,
                              last=last, image=image)  # fmt: skip
        patch["metadata"] = {"annotations": {manifests.ENGINE_URL_ANNOTATION: proc.url}}
        patch["spec"] = {"nodeName": NODE}
        await self._patch(ns, name, patch)

    async def _fail(self, pod: dict[str, Any], state: dict[str, Any]) -> None:
        name, ns = pod["metadata"]["name"], pod["metadata"]["namespace"]
        self.failed.add(name)
        self._starting.discard(name)
        count = self.restarts.get(name, 0)
        await self._patch(ns, name, ks.pod_status("Failed", state, restarts=count))

    async def _patch(self, ns: str, name: str, patch: dict[str, Any]) -> None:
        await self.client.patch(PODS, name, patch, namespace=ns)

    def kill(self, pod: str) -> None:
        """SIGKILL the engine of `pod` (no checkpoint on the way out) as in a node loss:
        the Pod turns `Failed`, its container is not restarted."""
        self._lost.add(pod)
        self.processes[pod].kill()


def _http_ok(url: str, timeout: float) -> bool:
    try:
        return httpx.get(url, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def restarts_after(pod: dict[str, Any], exit_code: int | None) -> bool:
    """Whether the kubelet restarts a container that exited with `exit_code`."""
    policy = pod.get("spec", {}).get("restartPolicy") or "Always"  # the API's default
    return policy == "Always" or (policy == "OnFailure" and exit_code != 0)


def crash_backoff(restart: int) -> float:
    """Seconds the kubelet waits before the `restart`-th restart (1-based)."""
    return 0.0 if restart <= 1 else min(BACKOFF_S * 2 ** (restart - 2), MAX_BACKOFF_S)


def _terminating(pod: dict[str, Any]) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))
