"""The operator's and the gateway's rendered RBAC is exactly rbac-contract.yaml (`rules`
and `gatewayRules`), placed as each RBAC mode says, each bound to its own ServiceAccount;
the aggregated ClusterRoles give users read (view) and write (edit) on the kinds."""

from __future__ import annotations

import pytest
import yaml

from tests.support.chart_helpers import (
    CONTRACT,
    NAMESPACE,
    SCENARIOS,
    by_kind,
    component,
    operator_deployment,
    render,
)

SCOPES = {"cluster", "watched", "engines", "operatorNamespace", "engineSecret", "engineNamespace"}
MODES = {"cluster", "namespaced"}
SECRET = "loraplex-engine-token"
KEYS = {"apiGroups", "resources", "verbs", "scope", "modes", "why", "unobserved", "generatedToken"}
KEYS |= {"aibrix"}
VALID_VERBS = {"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"}


def contract() -> dict:
    return yaml.safe_load(CONTRACT.read_text())


def test_contract_is_well_formed() -> None:
    data = contract()
    assert data["kopfFlags"] == ["--standalone"]
    for rule in data["rules"]:
        assert set(rule) <= KEYS, rule
        assert rule["scope"] in SCOPES, rule
        assert set(rule.get("modes", MODES)) <= MODES, rule
        assert set(rule["verbs"]) <= VALID_VERBS, rule
        assert rule["why"], rule
        assert "*" not in rule["resources"] + rule["verbs"] + rule["apiGroups"], rule
        # unobserved: reasons for verbs of this rule (test_chart_rbac_usage.py reads them)
        unobserved = rule.get("unobserved", {})
        assert set(unobserved) <= set(rule["verbs"]) and all(unobserved.values()), rule


def _triples(rules: list[dict]) -> set[tuple]:
    out = set()
    for rule in rules:
        names = tuple(rule.get("resourceNames", ()))
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    out.add((group, resource, verb, names))
    return out


def expected(
    mode: str,
    watched: list[str],
    engine_ns: str,
    secret: str = SECRET,
    generated: bool = True,
    aibrix: bool = False,
) -> dict[str, set[tuple]]:
    """Where each contract rule must be granted: 'cluster' or a namespace → triples."""
    out: dict[str, set[tuple]] = {}
    for rule in contract()["rules"]:
        if mode not in rule.get("modes", MODES) or (rule.get("generatedToken") and not generated):
            continue
        if rule.get("aibrix") and not aibrix:
            continue
        scope = rule["scope"]
        if scope == "engineSecret":
            targets, rule = [engine_ns], {**rule, "resourceNames": [secret]}
        elif scope == "engineNamespace":
            targets = [engine_ns]
        elif scope == "cluster" or mode == "cluster":
            targets = ["cluster"]
        elif scope == "watched":
            targets = watched
        elif scope == "operatorNamespace":
            targets = [NAMESPACE]
        else:
            targets = [engine_ns]
        for target in targets:
            out.setdefault(target, set()).update(_triples([rule]))
    return out


AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"


def _aggregated(role: dict) -> bool:
    return any(k.startswith(AGGREGATE) for k in role["metadata"].get("labels") or {})


def operator_roles(docs: list[dict], kind: str, who: str = "operator") -> list[dict]:
    """The (Cluster)Roles of `who` (operator, gateway; never those aggregated into user
    roles, which carry no component)."""
    return [r for r in component(docs, kind, who) if not _aggregated(r)]


def rendered(docs: list[dict], who: str = "operator") -> dict[str, set[tuple]]:
    out: dict[str, set[tuple]] = {}
    for role in operator_roles(docs, "ClusterRole", who):
        out.setdefault("cluster", set()).update(_triples(role["rules"]))
    for role in operator_roles(docs, "Role", who):
        out.setdefault(role["metadata"]["namespace"], set()).update(_triples(role["rules"]))
    return out


@pytest.mark.parametrize(
    ("scenario", "mode", "watched", "engine_ns"),
    [
        ("default", "cluster", [], NAMESPACE),
        ("all-on", "cluster", [], NAMESPACE),
        ("namespaced", "namespaced", ["team-a", "team-b"], NAMESPACE),
        ("engines-elsewhere", "namespaced", ["team-a", "team-b"], "gpu-engines"),
    ],
)
def test_rendered_rbac_matches_contract(scenario, mode, watched, engine_ns) -> None:
    docs = render(SCENARIOS[scenario])
    assert rendered(docs) == expected(mode, watched, engine_ns)


@pytest.mark.parametrize(
    ("scenario", "mode", "watched"),
    [("aibrix", "cluster", []), ("aibrix-namespaced", "namespaced", ["team-a", "team-b"])],
)
def test_aibrix_adds_its_modeladapter_grants(scenario: str, mode: str, watched: list) -> None:
    grants = rendered(render(SCENARIOS[scenario]))
    assert grants == expected(mode, watched, NAMESPACE, aibrix=True)
    where = {t for targets in grants.values() for t in targets if t[0] == "model.aibrix.ai"}
    assert {t[2] for t in where} == {"list", "create", "patch", "delete"}
    assert not any(t[0] == "model.aibrix.ai" for t in _triples(_all_rules(SCENARIOS["default"])))


def _all_rules(values: dict) -> list[dict]:
    docs = render(values)
    return [r for kind in ("ClusterRole", "Role") for role in operator_roles(docs, kind)
            for r in role["rules"]]  # fmt: skip


def test_with_an_existing_secret_the_operator_may_create_no_secret() -> None:
    docs = render(SCENARIOS["existing-secret"])
    assert rendered(docs) == expected(
        "cluster", [], NAMESPACE, secret="my-engine-token", generated=False
    )


@pytest.mark.parametrize("scenario", ["default", "namespaced"])
def test_the_operator_writes_pods_only_in_the_engine_namespace(scenario: str) -> None:
    """Both modes: pods are created and deleted through the engine namespace's Role, never
    a ClusterRole (cluster mode keeps only kopf's list and watch cluster-wide)."""
    grants = rendered(render(SCENARIOS[scenario]))
    writes = {"create", "delete", "patch", "update", "get"}
    assert not {t for t in grants.get("cluster", set()) if t[1] == "pods" and t[2] in writes}
    assert {("", "pods", v, ()) for v in ("get", "create", "delete")} <= grants[NAMESPACE]
    secrets = {t for target in grants.values() for t in target if t[1] == "secrets"}
    assert secrets == {("", "secrets", "get", (SECRET,)), ("", "secrets", "create", ())}


@pytest.mark.parametrize("scenario", ["default", "namespaced", "engines-elsewhere"])
def test_bindings_bind_the_operator(scenario: str) -> None:
    docs = render(SCENARIOS[scenario])
    for who in ("operator", "gateway"):
        [dep] = component(docs, "Deployment", who)
        sa = dep["spec"]["template"]["spec"]["serviceAccountName"]
        own = operator_roles(docs, "ClusterRole", who) + operator_roles(docs, "Role", who)
        roles = {(r["kind"], r["metadata"].get("namespace"), r["metadata"]["name"]) for r in own}
        bindings = component(docs, "ClusterRoleBinding", who) + component(docs, "RoleBinding", who)
        assert len(bindings) == len(roles)
        for b in bindings:
            ns = b["metadata"].get("namespace")
            assert (b["roleRef"]["kind"], ns, b["roleRef"]["name"]) in roles, b
            assert b["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
    # two ServiceAccounts: the gateway reads key Secrets, the operator writes pods
    sas = {d["spec"]["template"]["spec"]["serviceAccountName"] for d in by_kind(docs, "Deployment")}
    assert len(sas) == 2, sas
    all_bindings = by_kind(docs, "ClusterRoleBinding") + by_kind(docs, "RoleBinding")
    assert len(all_bindings) == sum(
        len(component(docs, k, w))
        for k in ("ClusterRoleBinding", "RoleBinding")
        for w in ("operator", "gateway")
    )


def test_kopf_flags_match_contract() -> None:
    args = operator_deployment(render())["spec"]["template"]["spec"]["containers"][0]["args"]
    for flag in contract()["kopfFlags"]:
        assert flag in args


def test_no_rbac_when_disabled() -> None:
    docs = render(SCENARIOS["minimal"])
    assert not [d for d in docs if d["apiVersion"].startswith("rbac.authorization.k8s.io")]
    sa = operator_deployment(docs)["spec"]["template"]["spec"]["serviceAccountName"]
    assert sa == "preexisting-sa"


def _aggregate_grants(docs: list[dict], role: str) -> set[tuple]:
    """What `role` (view, edit, admin) gains: every aggregated ClusterRole labelled for it."""
    labelled = [r for r in by_kind(docs, "ClusterRole")
                if (r["metadata"].get("labels") or {}).get(AGGREGATE + role) == "true"]  # fmt: skip
    return _triples([rule for r in labelled for rule in r["rules"]])


@pytest.mark.parametrize("scenario", ["default", "namespaced"])
def test_default_user_roles_read_both_kinds_and_edit_experiments_only(scenario: str) -> None:
    docs = render(SCENARIOS[scenario])
    reads = {"get", "list", "watch"}
    writes = {"create", "update", "patch", "delete", "deletecollection"}
    g = "loraplex.dev"
    view, edit, admin = (_aggregate_grants(docs, r) for r in ("view", "edit", "admin"))
    both = ("loraexperiments", "enginepools")
    assert view == {(g, res, v, ()) for res in both for v in reads} | {
        (g, f"{res}/status", v, ()) for res in both for v in reads
    }
    # edit = view + writes on experiments; EnginePools (cluster-scoped: where engines run
    # and what they cost) stay read-only for namespace users.
    assert edit == view | {(g, "loraexperiments", v, ()) for v in writes}
    assert admin == edit  # admin aggregates edit's rules, as Kubernetes' own roles do
    assert not any(_aggregated(r) for r in by_kind(docs, "Role"))  # ClusterRoles only
    bound = {b["roleRef"]["name"] for b in by_kind(docs, "ClusterRoleBinding")}
    assert not bound & {
        r["metadata"]["name"] for r in by_kind(docs, "ClusterRole") if _aggregated(r)
    }


def test_aggregate_roles_can_be_turned_off() -> None:
    docs = render({"rbac": {"aggregateToDefaultRoles": False}})
    assert not [r for r in by_kind(docs, "ClusterRole") if _aggregated(r)]
    assert operator_roles(docs, "ClusterRole")  # the operator keeps its own


GATEWAY_SCOPES = {"cluster", "engineNamespace", "keys"}


def test_gateway_contract_is_well_formed_and_writes_only_experiments() -> None:
    for rule in contract()["gatewayRules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs", "scope", "why"}, rule
        assert rule["scope"] in GATEWAY_SCOPES and rule["why"], rule
        if rule["resources"] == ["loraexperiments"]:  # Tinker models as experiments
            assert set(rule["verbs"]) == {"get", "create", "delete", "patch"}, rule
        else:
            assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule  # reads only
        assert "*" not in rule["resources"] + rule["verbs"] + rule["apiGroups"], rule


def expected_gateway(engine_ns: str, key_namespaces: list[str]) -> dict[str, set[tuple]]:
    out: dict[str, set[tuple]] = {}
    for rule in contract()["gatewayRules"]:
        scope = rule["scope"]
        if scope == "cluster" or (scope == "keys" and not key_namespaces):
            targets = ["cluster"]
        elif scope == "engineNamespace":
            targets = [engine_ns]
        else:
            targets = key_namespaces
        for target in targets:
            out.setdefault(target, set()).update(_triples([rule]))
    return out


@pytest.mark.parametrize(
    ("scenario", "key_namespaces", "engine_ns"),
    [
        ("default", [], NAMESPACE),
        ("default", ["team-b", "team-a"], NAMESPACE),
        ("engines-elsewhere", [], "gpu-engines"),
        ("engines-elsewhere", ["team-a"], "gpu-engines"),
    ],
)
def test_rendered_gateway_rbac_matches_contract(
    scenario: str, key_namespaces: list[str], engine_ns: str
) -> None:
    docs = render({**SCENARIOS[scenario], "gateway": {"keys": {"namespaces": key_namespaces}}})
    assert rendered(docs, "gateway") == expected_gateway(engine_ns, sorted(key_namespaces))
    # and the operator's stays exactly its own contract (the gateway adds nothing to it)
    assert rendered(docs) == rendered(render(SCENARIOS[scenario]))


def test_no_gateway_rbac_when_rbac_is_off_or_the_gateway_is() -> None:
    for values in (SCENARIOS["minimal"], SCENARIOS["no-gateway"]):
        docs = render(values)
        assert not any(component(docs, k, "gateway") for k in ("ClusterRole", "Role"))
    [dep] = component(render(SCENARIOS["minimal"]), "Deployment", "gateway")
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "preexisting-gateway-sa"
