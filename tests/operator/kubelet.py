"""The test "kubelet": runs every engine Pod of the emulator as a local process and
reports its status, as a node would.

Each engine Pod's container runs as the operator wrote it (`pod_runtime`: its command,
args and env; its volumes as local directories, the Secret volume as a file; the model
path of the image as the local model). The engine binds a free port, which the kubelet
publishes as the Pod's `loraplex.dev/engine-url` annotation with `podIP` 127.0.0.1.
Deleting a Pod that runs is graceful (see `harness.ApiServer`): SIGTERM, wait for the
exit (the engine checkpoints first), then let the API server remove the Pod. A process
that dies turns its Pod `Failed` (as after a node loss).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kmock
from loraplex_operator import manifests
from loraplex_operator.kube import PODS, Kube
from pod_runtime import Node, SecretReader, container_env, local_command, local_env

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from server_process import EngineServer

NODE = "kmock-node"
# Holds a deleted Pod while its engine shuts down (a real API server does this natively).
KUBELET_HOLD = "kmock.loraplex.dev/kubelet"


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class PodEngine(EngineServer):
    """An engine Pod's container as a process: `EngineServer`'s start (it waits for the
    listening and ready lines and /readyz), stop and kill, on the Pod's command line."""

    def __init__(
        self, pod: Mapping[str, Any], node: Node, read_secret: SecretReader | None
    ) -> None:
        meta = pod["metadata"]
        container = next(c for c in pod["spec"]["containers"] if c["name"] == manifests.CONTAINER)
        self.volumes = node.volume_dirs(pod, read_secret)  # volume name -> local directory
        mapped = node.path_map(container, self.volumes)
        self.argv = local_command(container, mapped)
        self.environment = local_env(container_env(pod, container), mapped)
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


@dataclass
class Kubelet:
    """Runs an engine process per engine Pod of the emulator and reports Pod status."""

    api: kmock.KubernetesEmulator
    client: Kube
    node: Node
    processes: dict[str, PodEngine] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    start_seconds: dict[str, float] = field(default_factory=dict)
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
        for name, proc in list(self.processes.items()):
            if name not in pods:  # removed without a grace period
                del self.processes[name]
                await asyncio.to_thread(proc.stop, 30.0)
            elif not proc.alive() and name not in self.failed:
                self.failed.add(name)
                ns = pods[name]["metadata"]["namespace"]
                await self._patch(ns, name, _pod_status(False, phase="Failed"))

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

    def _start_engine(self, pod: dict[str, Any]) -> PodEngine:
        engine = PodEngine(pod, self.node, self._secret_data)
        self._started.append(engine)
        try:
            engine.start()
        finally:
            if self._closed:
                engine.kill()
        return engine

    async def _run_pod(self, pod: dict[str, Any]) -> None:
        name, ns = pod["metadata"]["name"], pod["metadata"]["namespace"]
        try:
            t0 = time.monotonic()
            loop = asyncio.get_running_loop()
            proc = await loop.run_in_executor(self._starter, self._start_engine, pod)
            self.start_seconds[name] = time.monotonic() - t0
        except Exception as e:
            print(f"kubelet: engine for pod {name} failed to start: {e!r}", file=sys.stderr)
            self.failed.add(name)
            self._starting.discard(name)
            await self._patch(ns, name, _pod_status(False, phase="Failed"))
            return
        self._starting.discard(name)
        if name not in self._pods():  # deleted while starting
            await asyncio.to_thread(proc.stop, 30.0)
            return
        self.processes[name] = proc
        patch = _pod_status(True, phase="Running")
        patch["metadata"] = {"annotations": {manifests.ENGINE_URL_ANNOTATION: proc.url}}
        patch["spec"] = {"nodeName": NODE}
        await self._patch(ns, name, patch)

    async def _patch(self, ns: str, name: str, patch: dict[str, Any]) -> None:
        await self.client.patch(PODS, name, patch, namespace=ns)

    def kill(self, pod: str) -> None:
        """SIGKILL the engine of `pod` (no checkpoint on the way out)."""
        self.processes[pod].kill()


def _terminating(pod: dict[str, Any]) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


def _pod_status(ready: bool, phase: str) -> dict[str, Any]:
    flag = "True" if ready else "False"
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [
            {"type": "Ready", "status": flag, "lastTransitionTime": now()},
            {"type": "ContainersReady", "status": flag, "lastTransitionTime": now()},
        ],
    }
    if ready:
        status["podIP"] = "127.0.0.1"
    return {"status": status}
