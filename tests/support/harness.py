"""Operator integration harness: a Kubernetes API (kmock, or a real cluster), a "kubelet"
that runs a real engine process for every engine Pod, and the real operator process.

kmock mode (default)::

    async with Harness.kmock(tmp_path, tiny_model_dir) as h:
        await h.apply_pool(h.pool_obj("pool-a", slots=4, replicas=(0, 2)))
        await h.apply(h.experiment_obj("exp1", max_steps=6))
        await h.wait_phase("team-a", "exp1", "Succeeded")

- `ApiServer` is kmock's `KubernetesEmulator` with what our tests need from a real API
  server: names from `generateName` (kopf's Events), `uid`, `creationTimestamp`,
  `generation`, a new `resourceVersion` per write, and for our two CRDs structural
  defaults plus the schema and CEL checks
  (`crdkit.admit`), answering 422 like the API server would: on create, and on a merge
  patch of the main resource that touches `spec` (CEL transition rules against the
  stored object). Other patches (kopf's metadata, status) are not validated.
- `Kubelet` (kubelet.py) runs each engine Pod's container as the operator wrote it
  (command, args, env; volumes as local directories, the token Secret as a file;
  `pod_runtime.py` says what is mapped) and marks the Pod Running/Ready with `podIP`
  127.0.0.1 and the `loraplex.dev/engine-url` annotation (each engine binds its own
  port). Deleting a Pod that runs is graceful, as in Kubernetes: the API server sets
  `deletionTimestamp` to now + `terminationGracePeriodSeconds` and keeps the Pod (held by
  the kubelet's finalizer `KUBELET_HOLD`); the kubelet sends SIGTERM, and once the engine
  has exited (it checkpoints first) removes the Pod. A process that dies → the Pod turns
  `Failed` (as after a node loss).
- `OperatorProcess` (deployed.py) runs the operator container exactly as `helm template`
  renders it for `chart_values` (default: the chart's defaults, with free ports and the
  harness's short intervals as `operator.extraEnv`), with the image's `kopf` mapped to
  the virtualenv's, against a kubeconfig that points at the emulator; tests may kill and
  restart it.
- Every process the harness starts runs in its own process group, killed at teardown and
  at interpreter exit (`tests/support/child_processes.py`); a run that leaves one fails.

Real-cluster mode (`make e2e`, `KUBECONFIG` set, `LORAPLEX_E2E=1`): no emulator and no
kubelet; the CRDs must be installed and `LORAPLEX_E2E_IMAGE` names an engine image that
holds the model at `LORAPLEX_E2E_MODEL` (default /models/tiny-llama). "Killing an
engine" deletes its Pod with a zero grace period.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import copy
import itertools
import os
import re
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kmock
import kmock._internal.dsl as kmock_dsl
import kmock._internal.parsing as kmock_parsing
import yaml
from loraplex_operator import manifests
from loraplex_operator.kube import EXPERIMENTS, NAMESPACES, PODS, POOLS, SECRETS, Kube

from tests.support.crdkit import admit, apply_defaults, schema_of
from tests.support.deployed import OperatorProcess, chart_values, rendered_operator
from tests.support.kubelet import KUBELET_HOLD, Kubelet, now
from tests.support.paths import REPO_ROOT
from tests.support.pod_runtime import Node

ENGINE_NS = "loraplex-system"
TOKEN_SECRET = "engine-token"
ENGINE_MODEL = "/models/tiny-llama"  # where the engine image holds the model
# Kueue's pod integration: the queue label, and the gate its webhook puts on such Pods.
KUEUE_QUEUE_LABEL = manifests.KUEUE_QUEUE_LABEL
KUEUE_GATE = {"name": "kueue.x-k8s.io/admission"}

# --- the API server --------------------------------------------------------------------

CRD_KINDS = {"loraexperiments": "LoRAExperiment", "enginepools": "EnginePool"}


# The harness's own client (tests, kubelet) authenticates with this token.
HARNESS_TOKEN = "harness-" + secrets.token_hex(8)


# The request kmock is finding a reaction for, in that request's task (see ApiServer).
_MATCHING: contextvars.ContextVar[Any] = contextvars.ContextVar("matching", default=None)


class ApiServer(kmock.KubernetesEmulator):
    """kmock plus the few API-server behaviours the operator relies on."""

    # Bearer tokens let in besides HARNESS_TOKEN; None = no authentication at all.
    tokens: set[str] | None = None
    # (plural, namespace, name, monotonic time) of every object created, for tests that
    # count creations (a pod can be created and gone between two polls).
    creations: list[tuple[str, str | None, str, float]]

    def __iter__(self) -> Any:
        """Every request served so far; while a request's reaction is being chosen, only
        that request. kmock decides whether a reaction serves a request by filtering every
        request it has recorded (`request in view`): each request cost O(all requests),
        and a burst of 1,000 creates plus the operator's patches saturated the server
        (0.9 s per request after ~700). Reactions without slices (`[:n]`, the only
        history-dependent view) match a request by its own criteria, so the answer is
        the same."""
        current = _MATCHING.get()
        if current is not None:
            yield current
        else:
            yield from super().__iter__()

    def _KubernetesEmulator__get_objs(self, request: Any, strict: bool) -> list[Any]:
        """kmock's object lookup, by key when the request names one object (a get, patch,
        delete or create): kmock scans every stored object, a fifth of the server's time
        with 1,000 experiments and their Events. Lists and watches still scan."""
        if not (strict and request.name is not None):
            return super()._KubernetesEmulator__get_objs(request, strict)  # type: ignore[misc]
        key = (request.resource, request.namespace, request.name)
        return [self.objects[key]] if key in self.objects else []

    def _history_free(self) -> bool:
        return not any(True for p in self._payloads for _ in p._walk(kmock_dsl.Slicer))

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
        if request.resource is not None and request.action == kmock.action.UPDATE:
            _version(request.data)
        token = _MATCHING.set(request) if self._history_free() else None
        try:
            return await super()._handle(request)
        finally:
            if token is not None:
                _MATCHING.reset(token)

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
        meta.setdefault("creationTimestamp", now())
        meta.setdefault("generation", 1)
        meta["resourceVersion"] = _next_version()
        if not hasattr(self, "creations"):
            self.creations = []
        self.creations.append(
            (request.resource.plural, meta.get("namespace"), meta.get("name", ""), time.monotonic())
        )
        if request.resource.plural == "pods" and KUEUE_QUEUE_LABEL in (meta.get("labels") or {}):
            _kueue_gate(obj)
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


_VERSIONS = itertools.count(1)


def _next_version() -> str:
    return str(next(_VERSIONS))


def _version(patch: Any) -> None:
    """A write gets a new `metadata.resourceVersion`, as on a real API server. kopf waits
    after its own patch for the event carrying the version the patch returned, and treats
    earlier events as stale; with one constant version an event from before its patch
    passed for the patched object, and kopf ran a creation handler again (up to 14 times
    per experiment, ~1,800 patches a minute at rest for 1,000 experiments). JSON patches'
    `test` of the version is dropped: kmock would answer a failed test with a 500, not a
    409 (no optimistic concurrency here). Changes the patch in place (kmock's requests
    are frozen, their bodies are not)."""
    version = _next_version()
    if isinstance(patch, dict):
        if not isinstance(patch.get("metadata"), dict):
            patch["metadata"] = {}
        patch["metadata"]["resourceVersion"] = version
    elif isinstance(patch, list):
        ops = [op for op in patch if op.get("path") != "/metadata/resourceVersion"]
        patch[:] = [*ops, {"op": "add", "path": "/metadata/resourceVersion", "value": version}]


def _kueue_gate(pod: dict[str, Any]) -> None:
    """What Kueue's pod webhook does to a Pod labelled with a queue: hold it behind the
    admission scheduling gate until the queue's quota admits it (`Harness.release_gate`
    plays Kueue admitting it; Kueue preempts by deleting the Pod)."""
    gates = pod.setdefault("spec", {}).setdefault("schedulingGates", [])
    if KUEUE_GATE not in gates:
        gates.append(dict(KUEUE_GATE))
    pod["status"] = {
        "phase": "Pending",
        "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"},
        ],
    }


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


_KMOCK_PARSE_PATH = kmock_parsing.parse_path


def _parse_path(path: str) -> kmock_parsing.ParsedPath:
    """kmock's `parse_path`, but `/api/v1/namespaces[/NAME[/status|/finalize]]` is the
    Namespace resource (kmock reads "namespaces" only as a namespace prefix and fails with
    a 500 on these paths, which kopf's namespace observer calls in namespaced mode)."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and (
        len(parts) <= 4 or (len(parts) == 5 and parts[4] in ("status", "finalize"))
    ):
        name = parts[3] if len(parts) > 3 else None
        sub = parts[4] if len(parts) > 4 else None
        return kmock_parsing.ParsedPath("", "v1", "namespaces", None, name, sub)
    return _KMOCK_PARSE_PATH(path)


kmock_parsing.parse_path = _parse_path


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
    # AIBrix's ModelAdapter CRD, as on a cluster that has AIBrix (the operator writes
    # them only with the chart's aibrix.enabled: operator/loraplex_operator/aibrix.py).
    api.resources["model.aibrix.ai/v1alpha1/modeladapters"] = kmock.ResourceInfo(
        kind="ModelAdapter",
        singular="modeladapter",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete", "update"},
        subresources={"status"},
    )


# --- RBAC: what the operator called vs. what the chart grants ------------------------

RBAC_CONTRACT = REPO_ROOT / "charts" / "loraplex" / "rbac-contract.yaml"
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


# --- the harness -------------------------------------------------------------------------


class Harness:
    """One API server (kmock or real), its kubelet, one operator process, helpers."""

    def __init__(
        self,
        workdir: Path,
        model_dir: Path,
        real_cluster: bool = False,
        chart_values: dict[str, Any] | None = None,
        tuned: bool = True,
    ) -> None:
        """`chart_values`: the chart values the operator is rendered with (the defaults
        when None). `tuned`: add the short intervals below as `operator.extraEnv`."""
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model_dir = model_dir
        self.real_cluster = real_cluster
        self.chart_values = chart_values
        self.tuned = tuned
        self.api: ApiServer | None = None
        self.kube: Kube | None = None
        self.kubelet: Kubelet | None = None
        self.operator: OperatorProcess | None = None
        self._stack = contextlib.AsyncExitStack()
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
            # The engine image holds the model at the pool's baseModel path.
            node = Node(self.workdir / "node", image_paths={ENGINE_MODEL: self.model_dir})
            self.kubelet = Kubelet(self.api, self.kube, node)
            await self.kubelet.start()
        await self._ensure_namespace_and_token()
        values = chart_values(self.chart_values, self.operator_env if self.tuned else None)
        self.operator = OperatorProcess(rendered_operator(values), kubeconfig, self.workdir)
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
        if self.operator is not None:
            await asyncio.to_thread(self.operator.kill)  # no-op unless the stop failed
        if self.kubelet is not None:
            await self.kubelet.close()
        if self.real_cluster and self.kube is not None:
            await self._cleanup_cluster()
        if self.kube is not None:
            await self.kube.close()
        await self._stack.aclose()

    async def _ensure_namespace_and_token(self) -> None:
        assert self.kube is not None
        for ns in (ENGINE_NS, "team-a", "team-b"):  # kopf in namespaced mode lists them
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
        for ns in ("team-a", "team-b"):
            for obj in await self.kube.list(EXPERIMENTS, ns):
                await self.kube.delete(EXPERIMENTS, obj["metadata"]["name"], ns)
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
        priority_classes: list[dict[str, Any]] | None = None,
        max_registered: int | None = None,
    ) -> dict[str, Any]:
        """`priority_classes`: the pool's spec.priorityClasses (absent when None).
        `max_registered`: adapters an engine registers (pages beyond its slots); None:
        its slots, so that an engine takes no more experiments than it has slots (the
        engine's own default pages, which would pack scenarios onto fewer engines)."""
        image = os.environ.get("LORAPLEX_E2E_IMAGE", "loraplex/engine-cpu:test")
        model = os.environ.get("LORAPLEX_E2E_MODEL", ENGINE_MODEL)
        spec: dict[str, Any] = {
            "baseModel": model,
            "rolloutBackend": "torch",
            "engineNamespace": ENGINE_NS,
            "capacity": {
                "maxAdapters": slots,
                "maxRank": max_rank,
                "maxRegistered": max_registered or slots,
            },
            "replicas": {"min": replicas[0], "max": replicas[1]},
            "template": {"image": image, "env": [{"name": "OMP_NUM_THREADS", "value": "1"}]},
            "tokenSecretRef": {"name": TOKEN_SECRET, "key": "token"},
        }
        if priority_classes is not None:
            spec["priorityClasses"] = priority_classes
        if replicas[1] > 1:  # shared by the engines (kmock: one host directory on its node)
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
        priority_class: str | None = None,
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
                **({"priorityClassName": priority_class} if priority_class else {}),
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

    def checkpoint_dir(self, pod: str) -> Path:
        """kmock: the local directory behind the checkpoint volume of engine Pod `pod`."""
        assert self.kubelet is not None, "only the test kubelet has local volumes"
        return self.kubelet.processes[pod].volumes[manifests.CHECKPOINT_VOLUME]

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

    async def release_gate(self, pod: str) -> None:
        """Kueue admits the engine Pod: its scheduling gates are lifted, the kubelet starts it."""
        assert self.kube is not None
        await self.kube.patch(PODS, pod, {"spec": {"schedulingGates": []}}, namespace=ENGINE_NS)

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
