"""The gateway's RBAC (rbac-contract.yaml, gatewayRules) against its real API calls.

The gateway's real `KubeDirectory` (the code its Deployment runs) reads a kmock API server
(tests/support/harness.py's `ApiServer`, which records every request) holding a pool that
admits namespaces by label, its token Secret and a ready engine pod, and API key Secrets
in two namespaces; once with `gateway.keys.namespaces` empty (key Secrets listed
cluster-wide) and once with one namespace. Both directions: every call it makes is granted
by a rule whose scope covers that namespace (else a 403 in a cluster), and every verb a
rule grants is called in one of the two runs (a grant no code uses is removed).
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import kmock
import yaml
from loraplex_operator import idle, manifests
from loraplex_operator.gateway import experiments as gx
from loraplex_operator.gateway.directory import KubeDirectory
from loraplex_operator.gateway.keys import KEY_LABEL, ROLE_LABEL
from loraplex_operator.kube import NAMESPACES, PODS, POOLS, SECRETS, Kube

from tests.support import builders
from tests.support.chart_helpers import CONTRACT
from tests.support.harness import ApiServer, declare_resources, operator_calls_in

ENGINE_NS = "engines"
POOL = "gw-pool"
TOKEN = "engine-token-" + "x" * 20
KEYS = {"team-a": "tml-" + "a" * 24, "team-b": "tml-" + "b" * 24}

Call = tuple[str, str, str, str | None]


def covers(scope: str, namespace: str | None, key_namespaces: tuple[str, ...]) -> bool:
    """Whether a gateway rule of `scope` grants a call made in `namespace`."""
    if scope == "cluster":
        return True
    if scope == "engineNamespace":
        return namespace == ENGINE_NS
    if scope == "keys":  # the ClusterRole without key namespaces, else a Role in each
        return not key_namespaces or namespace in key_namespaces
    raise AssertionError(f"unknown gateway scope {scope}")


def ungranted(rules: list[dict[str, Any]], calls: set[Call], key_ns: tuple[str, ...]) -> set[Call]:
    return {
        c
        for c in calls
        if not any(
            c[:3] == (g, r, v) and covers(rule["scope"], c[3], key_ns)
            for rule in rules
            for g in rule["apiGroups"]
            for r in rule["resources"]
            for v in rule["verbs"]
        )
    }


def unused(rules: list[dict[str, Any]], calls: set[Call]) -> set[tuple[str, str, str]]:
    granted = {
        (g, r, v)
        for rule in rules
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    return granted - {c[:3] for c in calls}


def _pod() -> dict[str, Any]:
    meta = {"name": f"{POOL}-engine-0", "namespace": ENGINE_NS}
    meta["labels"] = {manifests.POOL_LABEL: POOL}
    container = {"name": "engine", "image": "engine:test"}
    status = {"phase": "Running", "podIP": "10.0.0.7"}
    status["conditions"] = [{"type": "Ready", "status": "True"}]
    spec = {"containers": [container]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec, "status": status}


async def _seed(kube: Kube) -> None:
    for ns, labels in ((ENGINE_NS, {}), ("team-a", {"tier": "gold"}), ("team-b", {})):
        await kube.create(NAMESPACES, {"metadata": {"name": ns, "labels": labels}})
    token = {"token": base64.b64encode(TOKEN.encode()).decode()}
    secret = {"metadata": {"name": "engine-token", "namespace": ENGINE_NS}, "data": token}
    await kube.create(SECRETS, secret, ENGINE_NS)
    for ns, key in KEYS.items():
        labels = {KEY_LABEL: "true", ROLE_LABEL: "train"}
        data = {"key": base64.b64encode(key.encode()).decode()}
        meta = {"name": "my-key", "namespace": ns, "labels": labels}
        await kube.create(SECRETS, {"metadata": meta, "data": data}, ns)
    pool = builders.pool(POOL).namespace_selector({"matchLabels": {"tier": "gold"}}).obj()
    pool["spec"]["engineNamespace"] = ENGINE_NS
    pool["spec"]["tokenSecretRef"] = {"name": "engine-token", "key": "token"}
    await kube.create(POOLS, pool)
    await kube.create(PODS, _pod(), ENGINE_NS)


async def _tinker_model_lifecycle(directory: KubeDirectory) -> None:
    """What a Tinker model costs in API calls (gateway/tinker_models.py): create_model
    creates its experiment, each call reads it, a call to an idle-suspended one resumes
    it, unload_model deletes it."""
    session = "s0123456789abcdef0123"
    create = {"session_id": session, "model_seq_id": 0, "lora_config": {"rank": 4}}
    obj = gx.manifest("team-a", POOL, create)  # valid: the API server checks the schema
    name = obj["metadata"]["name"]
    assert await directory.create_experiment(obj)
    assert await directory.get_experiment("team-a", name) is not None
    await directory.patch_experiment("team-a", name, idle.resume_patch())
    assert await directory.delete_experiment("team-a", name)


async def _calls(key_namespaces: tuple[str, ...]) -> tuple[set[Call], KubeDirectory]:
    async with ApiServer() as api:
        declare_resources(api)
        async with kmock.Server(api) as server:
            url = str(server.url).rstrip("/")
            seeder = Kube(url, user_agent="loraplex-tests")
            gateway = Kube(url)  # as the gateway's: the default agent, recorded below
            try:
                await _seed(seeder)
                directory = KubeDirectory(gateway, key_namespaces)
                await directory.refresh()
                await _tinker_model_lifecycle(directory)
            finally:
                await seeder.close()
                await gateway.close()
            return operator_calls_in(api), directory


async def test_the_gateways_calls_are_what_its_rbac_grants(tmp_path: Path) -> None:
    rules = yaml.safe_load(CONTRACT.read_text())["gatewayRules"]
    seen: set[Call] = set()
    for key_ns in ((), ("team-a",)):
        calls, directory = await _calls(key_ns)
        # the view it built is the one a cluster would give it
        assert [(e.name, e.token) for e in directory.engines] == [(f"{POOL}-engine-0", TOKEN)]
        want = set(KEYS) if not key_ns else set(key_ns)
        assert {k for k in KEYS if directory.keys.lookup(KEYS[k])} == want
        assert directory.namespace_labels.get("team-a") == {"tier": "gold"}
        assert not ungranted(rules, calls, key_ns), (key_ns, ungranted(rules, calls, key_ns))
        seen |= calls
    assert not unused(rules, seen), f"granted, never called: {unused(rules, seen)}"


def test_the_comparison_wants_the_scope() -> None:
    """On made-up calls: a key list in a namespace the values do not name is refused, a
    cluster-wide one needs the ClusterRole; a granted verb never called is reported."""
    rule = {"apiGroups": [""], "resources": ["secrets"], "verbs": ["list"], "scope": "keys"}
    listed = {("", "secrets", "list", "team-b")}
    assert ungranted([rule], listed, ("team-a",)) == listed
    assert not ungranted([rule], listed, ())
    assert ungranted([rule], {("", "secrets", "get", "team-a")}, ())
    assert unused([rule], set()) == {("", "secrets", "list")}
