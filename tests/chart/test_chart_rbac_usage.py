"""Every verb the chart grants is one the operator uses (the other direction from the
harness's check that every call it makes is granted).

Each rule × verb of rbac-contract.yaml must be seen in the API calls of a real operator
run against kmock, in a namespace the rule's scope covers, or carry an `unobserved`
reason (the code path that needs it, and why kmock cannot reach it). A reason for a verb
the run does use is stale and fails too.

The run (kmock records every request; kopf and our client identify themselves by
User-Agent): the operator harness, cluster-wide as the chart's rbac.scope=cluster, a
real engine; a pool without engines, naming the chart's token Secret that no one created
(the operator creates it), is scaled up by an experiment that trains to
Succeeded and is deleted (kopf's finalizer, the release handler); the idle engine is
scaled down; the pool is deleted (kopf's daemon finalizer, its Event). The calls are
the same in namespaced mode (experiments listed per namespace instead of once) except
kopf's namespace observation, which the contract explains.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from loraplex_operator.kube import POOLS, SECRETS, Kube

from tests.support.chart_helpers import CONTRACT
from tests.support.harness import ENGINE_NS, Call, Harness, operator_calls_in

WATCHED = "team-a"
# kopf posts Events about cluster-scoped objects in its default namespace: the service
# account's namespace in a pod (the release namespace), "default" when the kubeconfig
# context names none (the runs here).
KOPF_DEFAULT_NS = "default"
POOL = "rbac-pool"
CHART_TOKEN = "loraplex-engine-token"  # the chart's default (release "loraplex")


def covers(scope: str, namespace: str | None) -> bool:
    """Whether a rule of `scope` is what grants a call in `namespace` in these runs."""
    if scope == "cluster":
        return True
    if scope == "watched":  # cluster mode lists and watches across namespaces
        return namespace in (WATCHED, None)
    if scope == "engines":  # cluster mode: kopf watches engine pods across namespaces
        return namespace in (ENGINE_NS, None)
    if scope in ("engineSecret", "engineNamespace"):
        return namespace == ENGINE_NS
    if scope == "operatorNamespace":
        return namespace == KOPF_DEFAULT_NS
    raise AssertionError(f"unknown scope {scope}")


def unused_grants(rules: list[dict[str, Any]], calls: set[Call]) -> list[str]:
    """Problems: a granted verb neither used nor explained, or explained but used."""
    problems = []
    for rule in rules:
        if rule.get("aibrix"):  # off in this run; tests/operator/test_aibrix_e2e.py uses them
            continue
        reasons = rule.get("unobserved", {})
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    used = any(
                        c[:3] == (group, resource, verb) and covers(rule["scope"], c[3])
                        for c in calls
                    )
                    what = f"{group or 'core'}/{resource} {verb} (scope {rule['scope']})"
                    if used and verb in reasons:
                        problems.append(f"{what}: used, but its `unobserved` reason says not")
                    elif not used and not reasons.get(verb):
                        problems.append(f"{what}: granted, never used, no `unobserved` reason")
    return problems


async def until(what: str, check: Callable[[], Awaitable[Any]], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.25)


async def _operator_calls(workdir: Path, model_dir: Path) -> set[Call]:
    async with Harness(workdir, model_dir) as h:
        assert h.kube is not None and h.api is not None and h.operator is not None
        pool = h.pool_obj(POOL, slots=2, max_rank=8, replicas=(0, 1))
        # The chart's own token Secret, which no one created: the operator does (and
        # the engine it starts mounts it).
        pool["spec"]["tokenSecretRef"] = {"name": CHART_TOKEN, "key": "token"}
        assert await h.kube.get(SECRETS, CHART_TOKEN, ENGINE_NS) is None
        await h.apply(pool)
        await h.apply(h.experiment_obj("rbac-exp", POOL, max_steps=2, every=1))
        await h.wait_phase(WATCHED, "rbac-exp", "Succeeded", timeout=240)
        await h.delete(WATCHED, "rbac-exp")

        async def no_engine() -> bool:
            return not await h.engine_pods(POOL)

        await until("the idle engine scaled down", no_engine, timeout=120)
        await h.kube.delete(POOLS, POOL)
        await until("the pool gone", lambda: _gone(h.kube, POOL))
        secret = await h.kube.get(SECRETS, CHART_TOKEN, ENGINE_NS)
        assert secret is not None and len(base64.b64decode(secret["data"]["token"])) == 48
        assert secret["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "loraplex-operator"
        await asyncio.to_thread(h.operator.stop)  # all its calls are in before reading
        return operator_calls_in(h.api)


async def _gone(kube: Kube, pool: str) -> bool:
    return await kube.get(POOLS, pool) is None


@pytest.mark.slow
async def test_every_granted_verb_is_used(tmp_path: Path, tiny_model_dir: Path) -> None:
    calls = await _operator_calls(tmp_path, tiny_model_dir)
    problems = unused_grants(yaml.safe_load(CONTRACT.read_text())["rules"], calls)
    seen = "\n".join(str(c) for c in sorted(calls, key=str))
    assert not problems, "\n".join(problems) + f"\n\ncalls seen:\n{seen}"


def test_usage_check_wants_the_scope_and_no_stale_reason() -> None:
    """The comparison itself, on made-up calls: a call in a namespace the scope does not
    cover is no use of the rule, and a reason for a used verb is reported."""
    rule = {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "get"], "scope": "engines"}
    explained = {**rule, "unobserved": {"get": "a race"}}
    in_engines = {("", "pods", "list", ENGINE_NS)}
    assert unused_grants([explained], in_engines) == []
    assert len(unused_grants([rule], in_engines)) == 1  # get: neither used nor explained
    assert len(unused_grants([explained], {("", "pods", "list", WATCHED)})) == 1
    stale = unused_grants([explained], in_engines | {("", "pods", "get", ENGINE_NS)})
    assert stale and "says not" in stale[0]
