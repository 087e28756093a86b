"""Operator integration harness: a Kubernetes API (kmock, or a real cluster), a "kubelet"
that runs a real engine process for every engine Pod, and the real operator process.

kmock mode (default)::

    async with Harness.kmock(tmp_path, tiny_model_dir) as h:
        await h.apply_pool(h.pool_obj("pool-a", slots=4, replicas=(0, 2)))
        await h.apply(h.experiment_obj("exp1", max_steps=6))
        await h.wait_phase("team-a", "exp1", "Succeeded")

- `ApiServer` is kmock's `KubernetesEmulator` with what our tests need from a real API
  server: names from `generateName` (kopf's Events), `uid`, `creationTimestamp`,
  `generation`, and for our two CRDs structural defaults plus the schema and CEL checks
  (`crdkit.admit`), answering 422 like the API server would: on create, and on a merge
  patch of the main resource that touches `spec` (CEL transition rules against the
  stored object). Other patches (kopf's metadata, status) are not validated.
- `Kubelet` watches the emulator's Pods; for each engine Pod it starts a real
  `loraplex-engine serve` on 127.0.0.1 (`tests/engine/server_process.EngineServer`),
  then patches the Pod Running/Ready with `podIP` 127.0.0.1 and the
  `loraplex.dev/engine-url` annotation (the port differs per engine). Deleting a Pod
  that runs is graceful, as in Kubernetes: the API server sets `deletionTimestamp` to
  now + `terminationGracePeriodSeconds` and keeps the Pod (held by the kubelet's
  finalizer `KUBELET_HOLD`); the kubelet sends SIGTERM, and once the engine has exited
  (it checkpoints first) removes the Pod. A process that dies → the Pod turns `Failed`
  (as after a node loss).
  All engines share one checkpoint directory, like a ReadWriteMany volume.
- `OperatorProcess` runs `python -m loraplex_operator` against a kubeconfig that points
  at the emulator; tests may kill and restart it.

Real-cluster mode (`make e2e`, `KUBECONFIG` set, `LORAPLEX_E2E=1`): no emulator and no
kubelet; the CRDs must be installed and `LORAPLEX_E2E_IMAGE` names an engine image that
holds the model at `LORAPLEX_E2E_MODEL` (default /models/tiny-llama). "Killing an
engine" deletes its Pod with a zero grace period.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import kmock
import yaml
from crdkit import admit, apply_defaults, schema_of
from loraplex_operator import manifests
from loraplex_operator.kube import EXPERIMENTS, NAMESPACES, PODS, POOLS, SECRETS, Kube

REPO = Path(__file__).resolve().parents[2]
ENGINE_NS = "loraplex-system"
TOKEN_SECRET = "engine-token"
NODE = "kmock-node"
# Holds a deleted Pod while its engine shuts down (a real API server does this natively).
KUBELET_HOLD = "kmock.loraplex.dev/kubelet"

# --- the API server --------------------------------------------------------------------

CRD_KINDS = {"loraexperiments": "LoRAExperiment", "enginepools": "EnginePool"}


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# The harness's own client (tests, kubelet) authenticates with this token.
HARNESS_TOKEN = "harness-" + secrets.token_hex(8)


class ApiServer(kmock.KubernetesEmulator):
    """kmock plus the few API-server behaviours the operator relies on."""

    # Bearer tokens let in besides HARNESS_TOKEN; None = no authentication at all.
    tokens: set[str] | None = None

    def refuses(self, request: Any) -> bool:
        if self.tokens is None:
            return False
        auth = next((v for k, v in request.headers.items() if k.lower() == "authorization"), "")
        return auth not in {f"Bearer {t}" for t in {*self.tokens, HARNESS_TOKEN}}

    async def _serve_list(self, request: Any) -> Any:
        """Label selectors, and pages of `limit` items (`continue`: the next offset)."""
        body = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        items = [i for i in body["items"] if selects(selector, i)]
        start = int(request.params.get("continue") or 0)
        limit = int(request.params.get("limit") or 0) or len(items)
        body["items"] = items[start : start + limit]
        if start + limit < len(items):
            body["metadata"] = {**body["metadata"], "continue": str(start + limit)}
        return body

    async def _serve_watch(self, request: Any) -> Any:
        selector = request.params.get("labelSelector")
        async for event in super()._serve_watch(request):
            if not isinstance(event, dict) or selects(selector, event.get("object")):
                yield event

    async def _handle(self, request: Any) -> Any:
        if self.refuses(request):
            return await self._render_error(
                kmock.KubernetesError(status=401, reason="Unauthorized", message="Unauthorized")
            )
        if request.resource is not None and isinstance(request.data, dict):
            errors: list[str] = []
            if request.action == kmock.action.CREATE:
                errors = self._on_create(request)
            elif request.action == kmock.action.UPDATE:
                errors = self._on_spec_patch(request)
            if errors:
                kind = CRD_KINDS.get(request.resource.plural, "")
                return await self._render_error(
                    kmock.KubernetesError(
                        status=422,
                        reason="Invalid",
                        message=f"{kind} is invalid: " + "; ".join(errors),
                    )
                )
        if (
            request.resource is not None
            and request.resource.group == ""
            and request.resource.plural == "pods"
            and request.action == kmock.action.DELETE
            and request.params.get("gracePeriodSeconds") != "0"
        ):
            self._begin_graceful_delete(request)
        return await super()._handle(request)

    def _begin_graceful_delete(self, request: Any) -> None:
        """A Pod on a node is not removed at once: it gets deletionTimestamp = now + its
        grace period and stays until the kubelet has stopped its containers."""
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return  # kmock answers 404
        pod = self.objects[key]
        meta = pod.get("metadata", {})
        if not pod.get("spec", {}).get("nodeName") or meta.get("deletionTimestamp"):
            return  # never started (removed at once), or already terminating
        grace = int(pod["spec"].get("terminationGracePeriodSeconds", 30))
        until = datetime.now(UTC) + timedelta(seconds=grace)
        pod.patch(
            {
                "metadata": {
                    "deletionTimestamp": until.strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "deletionGracePeriodSeconds": grace,
                    "finalizers": [*(meta.get("finalizers") or []), KUBELET_HOLD],
                }
            }
        )

    def _on_create(self, request: Any) -> list[str]:
        obj = request.data
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(4)
        if request.namespace and not meta.get("namespace"):
            meta["namespace"] = request.namespace
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _now())
        meta.setdefault("generation", 1)
        # kopf's JSON patches "test" metadata.resourceVersion; kmock keeps no versions, so
        # one constant version makes every such test pass (no optimistic concurrency here).
        meta["resourceVersion"] = "1"
        kind = CRD_KINDS.get(request.resource.plural)
        if kind is None or request.resource.group != "loraplex.dev":
            return []
        errors = admit(kind, obj)
        if not errors:
            defaulted = apply_defaults(schema_of(kind), obj)
            obj.clear()
            obj.update(defaulted)
        return errors

    def _on_spec_patch(self, request: Any) -> list[str]:
        """Schema and CEL (transition rules included) on the object a spec patch would make."""
        kind = CRD_KINDS.get(request.resource.plural)
        if (
            kind is None
            or request.resource.group != "loraplex.dev"
            or request.subresource
            or request.name is None
            or "spec" not in request.data
        ):
            return []
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return []  # kmock answers 404
        old = copy.deepcopy(self.objects[key].raw)
        return admit(kind, _merge_patch(old, request.data), old)


def selects(selector: str | None, obj: Any) -> bool:
    """Whether `obj`'s labels match a label selector (`k=v`, `k==v`, `k!=v`, `k`, `!k`,
    `k in (a,b)`, `k notin (a,b)`), as the API server filters lists and watches."""
    if not selector:
        return True
    labels = ((obj or {}).get("metadata") or {}).get("labels") or {}
    for term in (t.strip() for t in re.split(r",(?![^()]*\))", selector) if t.strip()):
        if m := re.fullmatch(r"(\S+)\s+(in|notin)\s+\((.*)\)", term):
            values = {v.strip() for v in m[3].split(",")}
            if (labels.get(m[1]) in values) != (m[2] == "in"):
                return False
        elif "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (`null` removes a key), on a copy."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge_patch(out.get(key), value)
    return out


def declare_resources(api: kmock.KubernetesEmulator) -> None:
    api.resources.load_bundled()
    api.resources["loraplex.dev/v1alpha1/loraexperiments"] = kmock.ResourceInfo(
        kind="LoRAExperiment",
        singular="loraexperiment",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete", "update"},
        shortnames={"lx", "loraexp"},
        subresources={"status"},
    )
    api.resources["loraplex.dev/v1alpha1/enginepools"] = kmock.ResourceInfo(
        kind="EnginePool",
        singular="enginepool",
        namespaced=False,
        verbs={"get", "list", "watch", "create", "patch", "delete", "update"},
        shortnames={"ep", "lxpool"},
        subresources={"status"},
    )


# --- RBAC: what the operator called vs. what the chart grants ------------------------

RBAC_CONTRACT = REPO / "charts" / "loraplex" / "rbac-contract.yaml"
OPERATOR_AGENTS = ("kopf/", "loraplex-operator/")
VERBS = {"LIST": "list", "WATCH": "watch", "FETCH": "get", "CREATE": "create"}
VERBS |= {"UPDATE": "patch", "DELETE": "delete"}


# (apiGroup, resource[/subresource], verb, namespace or None for cluster-wide)
Call = tuple[str, str, str, str | None]


def operator_calls_in(api: kmock.KubernetesEmulator) -> set[Call]:
    """Every call kopf or our client made, with the namespace it was made in."""
    calls: set[Call] = set()
    for req in list(api):
        agent = next((v for k, v in req.headers.items() if k.lower() == "user-agent"), "")
        if not agent.startswith(OPERATOR_AGENTS) or req.resource is None or req.action is None:
            continue
        if not req.resource.plural:  # API discovery: open to every authenticated user
            continue
        resource = req.resource.plural + (f"/{req.subresource}" if req.subresource else "")
        verb = VERBS[req.action.value]
        calls.add((req.resource.group, resource, verb, req.namespace or None))
    return calls


def operator_calls(api: kmock.KubernetesEmulator) -> set[tuple[str, str, str]]:
    """(apiGroup, resource[/subresource], verb) of every call kopf or our client made."""
    return {(group, resource, verb) for group, resource, verb, _ in operator_calls_in(api)}


def rbac_violations(calls: set[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """Calls that no rule of charts/loraplex/rbac-contract.yaml allows (a 403 in a cluster)."""
    rules = yaml.safe_load(RBAC_CONTRACT.read_text())["rules"]
    allowed = {
        (g, r, v)
        for rule in rules
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    return sorted(c for c in calls if c not in allowed)


# --- engines and the kubelet ---------------------------------------------------------------


class EngineHandle(Protocol):
    url: str

    def kill(self) -> None: ...
    def stop(self, timeout: float = 60.0) -> int | None: ...
    def alive(self) -> bool: ...


@dataclass
class EngineRequest:
    pod: str
    token: str
    max_adapters: int
    max_rank: int


Launcher = Callable[[EngineRequest], EngineHandle]  # blocking; runs in a thread


def _arg(args: list[str], flag: str, default: str) -> str:
    return args[args.index(flag) + 1] if flag in args else default


class RealEngine:
    """`tests/engine/server_process.EngineServer` behind the EngineHandle protocol."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.url = server.url

    def kill(self) -> None:
        self.server.kill()

    def stop(self, timeout: float = 60.0) -> int | None:
        return self.server.stop(timeout)

    def alive(self) -> bool:
        return self.server.proc is not None and self.server.proc.poll() is None


def engine_server_class() -> Any:
    """The real engine subprocess helper (tests/engine/server_process.py)."""
    sys.path.insert(0, str(REPO / "tests" / "engine"))
    from server_process import EngineServer

    return EngineServer


def real_launcher(model_dir: Path, checkpoint_root: Path, workdir: Path) -> Launcher:
    EngineServer = engine_server_class()

    def launch(req: EngineRequest) -> EngineHandle:
        server = EngineServer(
            model_dir,
            checkpoint_root,
            max_adapters=req.max_adapters,
            max_rank=req.max_rank,
            token=req.token,
            workdir=workdir / req.pod,
            threads=1,
        )
        return RealEngine(server.start())

    return launch


@dataclass
class Kubelet:
    """Runs an engine process per engine Pod of the emulator and reports Pod status."""

    api: kmock.KubernetesEmulator
    client: Kube
    launcher: Launcher
    processes: dict[str, EngineHandle] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    start_seconds: dict[str, float] = field(default_factory=dict)
    _starting: set[str] = field(default_factory=set)
    _stopping: dict[str, EngineHandle | None] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def _pods(self) -> dict[str, dict[str, Any]]:
        out = {}
        for (res, _ns, name), obj in list(self.api.objects.items()):
            if res.group == "" and res.plural == "pods" and not obj.deleted:
                raw = obj.raw
                if manifests.POOL_LABEL in (raw.get("metadata", {}).get("labels") or {}):
                    out[name] = raw
        return out

    def _secret(self, namespace: str, name: str, key: str) -> str | None:
        for (res, ns, n), obj in list(self.api.objects.items()):
            if res.plural == "secrets" and ns == namespace and n == name and not obj.deleted:
                data = obj.raw.get("data") or {}
                if key in data:
                    return base64.b64decode(data[key]).decode().strip()
        return None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        procs = [*self.processes.values(), *(p for p in self._stopping.values() if p)]
        await asyncio.gather(*(asyncio.to_thread(p.kill) for p in procs))
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

    async def _run_pod(self, pod: dict[str, Any]) -> None:
        name, ns = pod["metadata"]["name"], pod["metadata"]["namespace"]
        container = pod["spec"]["containers"][0]
        args = container.get("args", [])
        secret = next(v for v in pod["spec"]["volumes"] if v["name"] == manifests.TOKEN_VOLUME)
        key = secret["secret"]["items"][0]["key"]
        token = self._secret(ns, secret["secret"]["secretName"], key)
        try:
            if token is None:
                raise RuntimeError(f"secret {secret['secret']['secretName']} not found")
            req = EngineRequest(
                pod=name,
                token=token,
                max_adapters=int(_arg(args, "--max-adapters", "8")),
                max_rank=int(_arg(args, "--max-rank", "64")),
            )
            t0 = time.monotonic()
            proc = await asyncio.to_thread(self.launcher, req)
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
            {"type": "Ready", "status": flag, "lastTransitionTime": _now()},
            {"type": "ContainersReady", "status": flag, "lastTransitionTime": _now()},
        ],
    }
    if ready:
        status["podIP"] = "127.0.0.1"
    return {"status": status}


# --- the operator process ------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class OperatorProcess:
    kubeconfig: Path
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    metrics_port: int = 0
    starts: int = 0

    def start(self) -> None:
        self.starts += 1
        self.metrics_port = free_port()
        log = open(self.workdir / f"operator-{self.starts}.log", "wb")  # noqa: SIM115
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PYTHONUNBUFFERED": "1",
            **self.env,
        }
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "loraplex_operator",
                "--metrics-port",
                str(self.metrics_port),
                "--liveness-port",
                str(free_port()),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=str(self.workdir),
        )
        log.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_text(self) -> str:
        return "".join(
            (self.workdir / f"operator-{i}.log").read_text(errors="replace")
            for i in range(1, self.starts + 1)
        )

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"


# --- the harness -------------------------------------------------------------------------


class Harness:
    """One API server (kmock or real), its kubelet, one operator process, helpers."""

    def __init__(self, workdir: Path, model_dir: Path, real_cluster: bool = False) -> None:
        self.workdir = workdir
        self.model_dir = model_dir
        self.real_cluster = real_cluster
        self.checkpoint_root = workdir / "ckpt"
        self.checkpoint_root.mkdir(parents=True, exist_ok=True)
        self.api: ApiServer | None = None
        self.kube: Kube | None = None
        self.kubelet: Kubelet | None = None
        self.operator: OperatorProcess | None = None
        self._stack = contextlib.AsyncExitStack()
        self.launcher: Launcher | None = None
        # kmock: the kubeconfig `user` the operator gets, and the bearer tokens the API
        # server accepts from it (None: no authentication).
        self.kubeconfig_user: dict[str, Any] = {}
        self.api_tokens: set[str] | None = None
        self.operator_env: dict[str, str] = {
            "LORAPLEX_RECONCILE_INTERVAL": "1",
            "LORAPLEX_STATUS_INTERVAL": "0",
            "LORAPLEX_SCALE_DOWN_DELAY": "3",
            "LORAPLEX_ENGINE_TIMEOUT": "60",
        }

    @classmethod
    def create(cls, workdir: Path, model_dir: Path) -> Harness:
        real = bool(os.environ.get("LORAPLEX_E2E")) and bool(os.environ.get("KUBECONFIG"))
        return cls(workdir, model_dir, real_cluster=real)

    async def __aenter__(self) -> Harness:
        if self.real_cluster:
            kubeconfig = Path(os.environ["KUBECONFIG"])
            import kopf

            self.kube = Kube.from_environment(kopf.OperatorSettings())
        else:
            self.api = ApiServer()
            self.api.tokens = self.api_tokens
            declare_resources(self.api)
            await self._stack.enter_async_context(self.api)
            server = await self._stack.enter_async_context(kmock.Server(self.api))
            url = str(server.url).rstrip("/")
            kubeconfig = self.workdir / "kubeconfig"
            kubeconfig.write_text(yaml.safe_dump(_kubeconfig(url, self.kubeconfig_user)))
            self.kube = Kube(url, token=HARNESS_TOKEN, user_agent="loraplex-tests")
            launcher = self.launcher or real_launcher(
                self.model_dir, self.checkpoint_root, self.workdir / "engines"
            )
            self.kubelet = Kubelet(self.api, self.kube, launcher)
            await self.kubelet.start()
        await self._ensure_namespace_and_token()
        self.operator = OperatorProcess(kubeconfig, self.workdir, env=self.operator_env)
        self.operator.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.operator is not None:
            await asyncio.to_thread(self.operator.stop)
        try:
            if self.api is not None and RBAC_CONTRACT.exists() and exc[0] is None:
                calls = operator_calls(self.api)
                assert calls, "no operator API calls recorded"
                missing = rbac_violations(calls)
                assert not missing, f"operator calls outside {RBAC_CONTRACT.name}: {missing}"
        finally:
            await self._close()

    async def _close(self) -> None:
        if self.kubelet is not None:
            await self.kubelet.close()
        if self.real_cluster and self.kube is not None:
            await self._cleanup_cluster()
        if self.kube is not None:
            await self.kube.close()
        await self._stack.aclose()

    async def _ensure_namespace_and_token(self) -> None:
        assert self.kube is not None
        for ns in (ENGINE_NS, "team-a") if self.real_cluster else ():  # kmock: implicit
            if await self.kube.get(NAMESPACES, ns) is None:
                await self.kube.create(NAMESPACES, {"metadata": {"name": ns}})
        if await self.kube.get(SECRETS, TOKEN_SECRET, ENGINE_NS) is None:
            token = base64.b64encode(secrets.token_hex(24).encode()).decode()
            await self.kube.create(
                SECRETS,
                {
                    "metadata": {"name": TOKEN_SECRET, "namespace": ENGINE_NS},
                    "data": {"token": token},
                },
                ENGINE_NS,
            )

    async def _cleanup_cluster(self) -> None:
        assert self.kube is not None
        for obj in await self.kube.list(EXPERIMENTS, "team-a"):
            await self.kube.delete(EXPERIMENTS, obj["metadata"]["name"], "team-a")
        for obj in await self.kube.list(POOLS):
            if obj["metadata"]["name"].startswith("e2e-"):
                await self.kube.delete(POOLS, obj["metadata"]["name"])

    # -- objects --

    def pool_obj(
        self,
        name: str,
        slots: int = 4,
        max_rank: int = 16,
        replicas: tuple[int, int] = (0, 2),
    ) -> dict[str, Any]:
        image = os.environ.get("LORAPLEX_E2E_IMAGE", "loraplex/engine-cpu:test")
        model = os.environ.get("LORAPLEX_E2E_MODEL", "/models/tiny-llama")
        spec: dict[str, Any] = {
            "baseModel": model,
            "rolloutBackend": "torch",
            "engineNamespace": ENGINE_NS,
            "capacity": {"maxAdapters": slots, "maxRank": max_rank},
            "replicas": {"min": replicas[0], "max": replicas[1]},
            "template": {"image": image, "env": [{"name": "OMP_NUM_THREADS", "value": "1"}]},
            "tokenSecretRef": {"name": TOKEN_SECRET, "key": "token"},
        }
        if replicas[1] > 1:  # shared by all engines (kmock: the kubelet's shared directory)
            host = os.environ.get("LORAPLEX_E2E_CHECKPOINTS", "/var/lib/loraplex/checkpoints")
            volume = {"hostPath": {"path": host, "type": "DirectoryOrCreate"}}
            spec["checkpoint"] = {"root": "/ckpt", "volume": volume}
        return {
            "apiVersion": "loraplex.dev/v1alpha1",
            "kind": "EnginePool",
            "metadata": {"name": name},
            "spec": spec,
        }

    @staticmethod
    def experiment_obj(
        name: str,
        pool: str,
        max_steps: int = 6,
        every: int = 2,
        priority: int = 0,
        rank: int = 4,
        seed: int = 0,
        namespace: str = "team-a",
    ) -> dict[str, Any]:
        return {
            "apiVersion": "loraplex.dev/v1alpha1",
            "kind": "LoRAExperiment",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "enginePool": pool,
                "lora": {"rank": rank, "alpha": 2 * rank, "targetModules": ["q_proj", "v_proj"]},
                "task": {"name": "target-token", "params": {"target": "yes"}},
                "algorithm": {
                    "groupSize": 2,
                    "promptsPerStep": 2,
                    "learningRate": 0.001,
                    "maxSteps": max_steps,
                    "seed": seed,
                },
                "rollout": {"maxNewTokens": 4, "temperature": 1.0},
                "checkpoint": {"everySteps": every, "keep": 2},
                "priority": priority,
            },
        }

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        assert self.kube is not None
        res = POOLS if obj["kind"] == "EnginePool" else EXPERIMENTS
        return await self.kube.create(res, obj, obj["metadata"].get("namespace"))

    async def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        assert self.kube is not None
        return await self.kube.get(EXPERIMENTS, name, namespace)

    async def status(self, namespace: str, name: str) -> dict[str, Any]:
        obj = await self.get(namespace, name)
        return (obj or {}).get("status") or {}

    async def patch_spec(self, namespace: str, name: str, spec: dict[str, Any]) -> None:
        assert self.kube is not None
        await self.kube.patch(EXPERIMENTS, name, {"spec": spec}, namespace=namespace)

    async def delete(self, namespace: str, name: str) -> None:
        assert self.kube is not None
        await self.kube.delete(EXPERIMENTS, name, namespace)

    async def engine_pods(self, pool: str) -> list[dict[str, Any]]:
        assert self.kube is not None
        pods = await self.kube.list(PODS, ENGINE_NS, labels={manifests.POOL_LABEL: pool})
        return [p for p in pods if not p["metadata"].get("deletionTimestamp")]

    async def events(self, namespace: str, name: str) -> list[dict[str, Any]]:
        assert self.kube is not None
        from loraplex_operator.kube import Resource

        events = await self.kube.list(Resource("", "v1", "events"), namespace)
        return [e for e in events if (e.get("involvedObject") or {}).get("name") == name]

    async def kill_engine(self, pod: str) -> None:
        """The engine of `pod` dies with no checkpoint on the way out. kmock: SIGKILL its
        process. Real cluster: delete the Pod with a zero grace period, the closest the API
        offers (the kubelet still allows the container a short minimum before SIGKILL)."""
        if self.kubelet is not None:
            await asyncio.to_thread(self.kubelet.kill, pod)
        else:
            assert self.kube is not None
            await self.kube.delete(PODS, pod, ENGINE_NS, grace_seconds=0)

    async def stop_engine(self, pod: str) -> None:
        """Delete the engine Pod gracefully (a drain, an eviction): its engine gets SIGTERM,
        checkpoints what it runs and exits; the Pod is gone after that."""
        assert self.kube is not None
        await self.kube.delete(PODS, pod, ENGINE_NS)

    async def restart_operator(self, kill: bool = True) -> None:
        assert self.operator is not None
        await asyncio.to_thread(self.operator.kill if kill else self.operator.stop)
        self.operator.start()

    async def wait_for(
        self,
        what: str,
        check: Callable[[], Awaitable[Any]],
        timeout: float = 120.0,
        interval: float = 0.25,
    ) -> Any:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = await check()
            if last:
                return last
            if self.operator and self.operator.proc and self.operator.proc.poll() is not None:
                raise AssertionError(f"operator exited:\n{self.operator.log_text()[-6000:]}")
            await asyncio.sleep(interval)
        log = self.operator.log_text()[-6000:] if self.operator else ""
        raise AssertionError(f"timed out waiting for {what} (last: {last!r})\n{log}")

    async def wait_phase(
        self, namespace: str, name: str, *phases: str, timeout: float = 120.0
    ) -> dict[str, Any]:
        async def check() -> dict[str, Any] | None:
            status = await self.status(namespace, name)
            return status if status.get("phase") in phases else None

        return await self.wait_for(f"{namespace}/{name} in {phases}", check, timeout)


def _kubeconfig(server: str, user: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": server}}],
        "users": [{"name": "kmock", "user": user or {}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
    }
