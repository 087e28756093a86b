"""helm lint and helm template over the toggle combinations that matter."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from loraplex_operator.config import Config
from loraplex_operator.manifests import GPU_RESOURCE, engine_pod
from loraplex_operator.resources import Pool

from tests.support.chart_helpers import (
    ALL_ON,
    CHART,
    DASHBOARDS,
    NAMESPACE,
    RULES_FILE,
    SCENARIOS,
    _helm_template,
    by_kind,
    one,
    operator_deployment,
    render,
    render_notes,
    tool,
)
from tests.support.crdkit import admit

FULL = "loraplex"  # release "loraplex" + chart "loraplex" → full name "loraplex"


ALL_ON_SETS = [
    "--set",
    "monitoring.serviceMonitor.enabled=true,monitoring.podMonitor.enabled=true",
    "--set",
    "monitoring.prometheusRule.enabled=true,monitoring.dashboards.enabled=true",
    "--set",
    "networkPolicy.enabled=true,defaultPool.enabled=true",
]


@pytest.mark.parametrize("sets", [[], ALL_ON_SETS], ids=["default", "all-on"])
def test_helm_lint(sets: list[str]) -> None:
    proc = subprocess.run(
        [str(tool("helm")), "lint", "--strict", str(CHART), *sets],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_renders_well_formed(scenario: str) -> None:
    docs = render(SCENARIOS[scenario])
    assert docs, "nothing rendered"
    seen = set()
    for doc in docs:
        assert doc.get("apiVersion") and doc.get("kind"), doc
        meta = doc["metadata"]
        name = meta["name"]
        assert len(name) <= 63, f"{doc['kind']} name too long: {name}"
        key = (doc["kind"], meta.get("namespace"), name)
        assert key not in seen, f"duplicate {key}"
        seen.add(key)
        labels = meta.get("labels", {})
        assert labels.get("app.kubernetes.io/managed-by") == "Helm", key
        assert labels.get("app.kubernetes.io/part-of") == "loraplex", key


# Which kinds a scenario renders (count per kind).
# Two components, each with a Deployment, ServiceAccount and Service: the operator and
# the gateway (a PodDisruptionBudget too). ClusterRole: the operator's, the gateway's, and
# the view and edit roles aggregated into the default user roles; Role: each one's in the
# engine namespace; Service: the operator's metrics, the engines' (headless), the
# gateway's; Pod: the `helm test` hook; no Secret: the operator creates the token.
EXPECTED_KINDS = {
    "default": {
        "Deployment": 2, "ServiceAccount": 2, "ClusterRole": 4, "ClusterRoleBinding": 2,
        "Role": 2, "RoleBinding": 2, "Service": 3, "Pod": 1, "PodDisruptionBudget": 1,
    },
    "all-on": {
        "Deployment": 2, "ServiceAccount": 2, "ClusterRole": 4, "ClusterRoleBinding": 2,
        "Role": 2, "RoleBinding": 2, "Service": 3, "Secret": 0, "ServiceMonitor": 2,
        "PodMonitor": 1, "PrometheusRule": 1, "ConfigMap": len(DASHBOARDS),
        "NetworkPolicy": 1, "EnginePool": 1, "Pod": 1,
    },
    # the operator's: two watched namespaces, the engine namespace, its own namespace;
    # the gateway's: the engine namespace (keys: cluster-wide by default)
    "namespaced": {
        "Deployment": 2, "ServiceAccount": 2, "ClusterRole": 4, "ClusterRoleBinding": 2,
        "Role": 5, "RoleBinding": 5, "Service": 3, "Secret": 0, "Pod": 1,
    },
    "existing-secret": {"Secret": 0, "EnginePool": 1},
    # no RBAC, no ServiceAccounts (both preexisting), no operator metrics Service: the
    # gateway keeps its Service (tenants' way in)
    "minimal": {
        "Deployment": 2, "ServiceAccount": 0, "ClusterRole": 0, "Role": 0, "Service": 1,
        "Secret": 0, "Pod": 0,
    },
    "no-gateway": {
        "Deployment": 1, "ServiceAccount": 1, "ClusterRole": 3, "ClusterRoleBinding": 1,
        "Role": 1, "RoleBinding": 1, "Service": 2, "PodDisruptionBudget": 0,
    },
    "netpol-only": {"NetworkPolicy": 1, "EnginePool": 0, "ServiceMonitor": 0},
    "pool-only": {"NetworkPolicy": 0, "EnginePool": 1, "ConfigMap": 0},
    "monitoring-only": {
        "ServiceMonitor": 2, "PodMonitor": 1, "PrometheusRule": 1, "ConfigMap": len(DASHBOARDS),
        "NetworkPolicy": 0, "EnginePool": 0,
    },
}  # fmt: skip


@pytest.mark.parametrize("scenario", sorted(EXPECTED_KINDS))
def test_kinds_per_toggle(scenario: str) -> None:
    docs = render(SCENARIOS[scenario])
    counts: dict[str, int] = {}
    for doc in docs:
        counts[doc["kind"]] = counts.get(doc["kind"], 0) + 1
    for kind, n in EXPECTED_KINDS[scenario].items():
        assert counts.get(kind, 0) == n, f"{scenario}: {kind} x{counts.get(kind, 0)}, want {n}"
    if scenario == "default":
        assert set(counts) == set(EXPECTED_KINDS["default"]), counts


def _container(docs):
    dep = operator_deployment(docs)
    return dep, dep["spec"]["template"]["spec"]["containers"][0]


def test_operator_deployment_defaults() -> None:
    docs = render()
    dep, c = _container(docs)
    spec = dep["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    assert c["command"] == ["kopf"]
    args = c["args"]
    assert args[0] == "run"
    assert "--standalone" in args
    assert "--liveness=http://0.0.0.0:8081/healthz" in args
    assert "--all-namespaces" in args
    assert args[-2:] == ["-m", "loraplex_operator.handlers"]  # the module with the handlers
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"metrics": 8080, "health": 8081}
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
        assert c[probe]["periodSeconds"] > 0
    env = {e["name"]: e for e in c["env"]}
    assert env["LORAPLEX_METRICS_PORT"]["value"] == "8080"
    assert env["LORAPLEX_WATCH_NAMESPACES"]["value"] == ""
    # Only what the operator reads (the engine namespace and token come from each pool;
    # the token Secret it creates when absent, and the length of its token).
    assert set(env) == {
        "LORAPLEX_METRICS_PORT",
        "LORAPLEX_WATCH_NAMESPACES",
        "LORAPLEX_MANAGED_TOKEN_SECRET",
        "LORAPLEX_TOKEN_LENGTH",
        "LORAPLEX_LOG_FORMAT",
        "LORAPLEX_STALL_AFTER",
        "LORAPLEX_ENGINE_LOG_FORMAT",
    }
    assert env["LORAPLEX_LOG_FORMAT"]["value"] == "text"  # operator.logFormat
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert c["image"] == "ghcr.io/loraplex/operator:0.1.0"


def test_operator_pod_is_restricted() -> None:
    """Pod Security Standard "restricted" (the checks that apply to this pod)."""
    dep, c = _container(render())
    pod = dep["spec"]["template"]["spec"]
    psc, csc = pod["securityContext"], c["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0
    assert psc["seccompProfile"]["type"] in ("RuntimeDefault", "Localhost")
    assert csc["allowPrivilegeEscalation"] is False
    assert csc["capabilities"]["drop"] == ["ALL"]
    assert "add" not in csc["capabilities"]
    assert csc["readOnlyRootFilesystem"] is True
    assert not csc.get("privileged")
    assert not any(k in pod for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert all("hostPath" not in v for v in pod.get("volumes", []))
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/tmp"}


def test_namespaced_mode_args_and_env() -> None:
    _, c = _container(render(SCENARIOS["namespaced"]))
    assert "--all-namespaces" not in c["args"]
    assert [a for a in c["args"] if a.startswith("--namespace=")] == [
        "--namespace=team-a",
        "--namespace=team-b",
    ]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["LORAPLEX_WATCH_NAMESPACES"] == "team-a,team-b"


def test_image_digest_and_log_level() -> None:
    docs = render(SCENARIOS["digest-debug"])
    dep, c = _container(docs)
    assert c["image"] == "ghcr.io/loraplex/operator@sha256:" + "a" * 64
    assert "--debug" in c["args"]
    assert dep["metadata"]["name"] == "lp-operator"


def test_no_token_secret_rendered_the_operator_creates_it() -> None:
    """The chart renders no random Secret (GitOps: `helm template` must be stable); it
    tells the operator which one to create when absent (reconcile.token)."""
    docs = render()
    assert not by_kind(docs, "Secret")
    env = {e["name"]: e.get("value") for e in _container(docs)[1]["env"]}
    assert env["LORAPLEX_MANAGED_TOKEN_SECRET"] == f"{NAMESPACE}/{FULL}-engine-token"
    assert env["LORAPLEX_TOKEN_LENGTH"] == "48"
    existing = render(SCENARIOS["existing-secret"])
    env = {e["name"] for e in _container(existing)[1]["env"]}
    assert "LORAPLEX_MANAGED_TOKEN_SECRET" not in env


def test_stall_after_reaches_the_operator_config() -> None:
    """engines.stallAfterSeconds is what the operator's Config reads (default 600 s, the
    operator's own default; another value passes through as a number it parses)."""
    for values, expected in (
        ({}, Config.stall_after),
        ({"engines": {"stallAfterSeconds": 90}}, 90),
    ):
        env = {e["name"]: e["value"] for e in _container(render(values))[1]["env"] if "value" in e}
        assert Config.from_env(env).stall_after == expected


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({}, "text"),
        ({"operator": {"logFormat": "json"}}, "json"),  # one switch: operator and engines
        ({"operator": {"logFormat": "json"}, "engines": {"logFormat": "text"}}, "text"),
        ({"engines": {"logFormat": "json"}}, "json"),
    ],
)
def test_engine_log_format_reaches_the_operator_config(values: dict, expected: str) -> None:
    """engines.logFormat, else operator.logFormat: the engines' `serve --log-format`
    where a pool's template names none (Config.engine_log_format)."""
    env = {e["name"]: e["value"] for e in _container(render(values))[1]["env"] if "value" in e}
    assert Config.from_env(env).engine_log_format == expected


@pytest.mark.parametrize("scenario", ["default", "all-on", "existing-secret", "namespaced"])
def test_two_renders_are_the_same_for_gitops(scenario: str) -> None:
    """Argo CD and Flux render the chart with `helm template` on every sync: anything
    random in it (a generated token) would be a permanent diff."""
    values = json.dumps(SCENARIOS[scenario], sort_keys=True)
    # helm itself, twice (render() caches), as a GitOps tool runs it: CRDs included
    first, second = (_helm_template(values, None, True) for _ in range(2))
    assert first == second
    assert not by_kind([d for d in yaml.safe_load_all(first) if d], "Secret")


def test_existing_secret_is_used_everywhere() -> None:
    docs = render(SCENARIOS["existing-secret"])
    assert not by_kind(docs, "Secret")
    pool = one(docs, "EnginePool")
    assert pool["spec"]["tokenSecretRef"] == {"name": "my-engine-token", "key": "tok"}
    role = one(docs, "Role", f"{FULL}-operator-engines")
    secret_rules = [r for r in role["rules"] if "secrets" in r["resources"]]
    assert secret_rules == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"],
         "resourceNames": ["my-engine-token"]}
    ]  # fmt: skip


def test_default_pool() -> None:
    docs = render(SCENARIOS["pool-only"])
    pool = one(docs, "EnginePool")
    assert pool["apiVersion"] == "loraplex.dev/v1alpha1"
    assert "namespace" not in pool["metadata"], "EnginePool is cluster-scoped"
    assert pool["metadata"]["name"] == "default"
    spec = pool["spec"]
    assert spec["engineNamespace"] == NAMESPACE
    assert spec["tokenSecretRef"] == {"name": f"{FULL}-engine-token", "key": "token"}
    assert spec["baseModel"].startswith("/") and spec["template"]["image"]


def test_default_pool_engine_image_follows_the_app_version() -> None:
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    image = one(render(SCENARIOS["pool-only"]), "EnginePool")["spec"]["template"]["image"]
    assert image == f"ghcr.io/loraplex/engine:{app_version}"
    for pinned in ("registry.example:5000/loraplex/engine:9.9.9", "loraplex/engine@sha256:ab12"):
        values = {"defaultPool": {"enabled": True, "spec": {"template": {"image": pinned}}}}
        assert one(render(values), "EnginePool")["spec"]["template"]["image"] == pinned


def test_default_pool_with_two_ranks_per_engine() -> None:
    """gpusPerEngine passes through to a pool the CRD admits; its engine pods run two ranks
    (the chart's default pool is a CPU pool: gloo ranks, no GPU asked for)."""
    values = {"defaultPool": {"enabled": True, "spec": {"gpusPerEngine": 2}}}
    pool = one(render(values), "EnginePool")
    assert pool["spec"]["gpusPerEngine"] == 2 and admit("EnginePool", pool) == []
    pool["metadata"]["uid"] = "uid-default"
    (container,) = engine_pod(Pool.from_obj(pool), "a1b2c")["spec"]["containers"]
    assert container["args"][container["args"].index("--world-size") + 1] == "2"
    assert GPU_RESOURCE not in json.dumps(container["resources"])
    assert "gpusPerEngine" in one(render(SCENARIOS["pool-only"]), "EnginePool")["spec"]


def test_default_pool_sharding_its_base_over_two_ranks() -> None:
    """shardBase passes through to a pool the CRD admits; its engine pods run two ranks
    sharding the base (`--world-size 2 --shard-base`); off by default."""
    spec = {"gpusPerEngine": 2, "shardBase": True}
    pool = one(render({"defaultPool": {"enabled": True, "spec": spec}}), "EnginePool")
    assert pool["spec"]["shardBase"] is True and admit("EnginePool", pool) == []
    pool["metadata"]["uid"] = "uid-default"
    (container,) = engine_pod(Pool.from_obj(pool), "a1b2c")["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--world-size") :][:3] == ["--world-size", "2", "--shard-base"]
    plain = one(render(SCENARIOS["pool-only"]), "EnginePool")
    assert plain["spec"]["shardBase"] is False and admit("EnginePool", plain) == []


def test_engines_in_another_namespace() -> None:
    docs = render(SCENARIOS["engines-elsewhere"])
    ns = "gpu-engines"
    env = {e["name"]: e.get("value") for e in _container(docs)[1]["env"]}
    assert env["LORAPLEX_MANAGED_TOKEN_SECRET"] == f"{ns}/{FULL}-engine-token"
    assert one(docs, "NetworkPolicy")["metadata"]["namespace"] == ns
    assert one(docs, "PodMonitor")["spec"]["namespaceSelector"] == {"matchNames": [ns]}
    assert one(docs, "EnginePool")["spec"]["engineNamespace"] == ns
    assert one(docs, "Role", f"{FULL}-operator-engines")["metadata"]["namespace"] == ns
    engines_svc = one(docs, "Service", f"{FULL}-engines")
    assert engines_svc["metadata"]["namespace"] == ns
    # The operator itself stays in the release namespace.
    assert operator_deployment(docs)["metadata"]["namespace"] == NAMESPACE


def test_services() -> None:
    docs = render()
    op = one(docs, "Service", f"{FULL}-operator-metrics")
    assert op["spec"]["ports"] == [
        {"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"}
    ]
    dep = operator_deployment(docs)
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert op["spec"]["selector"].items() <= pod_labels.items()
    eng = one(docs, "Service", f"{FULL}-engines")
    assert eng["spec"]["clusterIP"] == "None"
    assert eng["spec"]["selector"] == {"app.kubernetes.io/component": "engine"}
    assert eng["spec"]["ports"][0]["targetPort"] == "http"
    assert eng["spec"]["ports"][0]["port"] == 8000


def test_monitors() -> None:
    docs = render(ALL_ON)
    sm = one(docs, "ServiceMonitor", f"{FULL}-operator")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    svc = one(docs, "Service", f"{FULL}-operator-metrics")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] == "metrics"
    # the operator's per-experiment series export `namespace` = the experiment's: keep it.
    assert ep["honorLabels"] is True
    assert {"action": "replace", "targetLabel": "job", "replacement": "loraplex-operator"} in ep[
        "relabelings"
    ]
    pm = one(docs, "PodMonitor")
    assert pm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/component": "engine"}
    assert {"key": "loraplex.dev/pool", "operator": "Exists"} in pm["spec"]["selector"][
        "matchExpressions"
    ]
    (pep,) = pm["spec"]["podMetricsEndpoints"]
    assert pep["port"] == "http" and pep["path"] == "/metrics"
    # engines export `namespace` = the experiment's namespace: keep it.
    assert pep["honorLabels"] is True
    relabel = {r["targetLabel"]: r for r in pep["relabelings"]}
    assert relabel["job"]["replacement"] == "loraplex-engine"
    assert relabel["pool"]["sourceLabels"] == ["__meta_kubernetes_pod_label_loraplex_dev_pool"]


def test_prometheus_rule_is_the_rules_file() -> None:
    docs = render(ALL_ON)
    rule = one(docs, "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(RULES_FILE.read_text())["groups"]


def test_runbook_url_replaces_the_placeholder() -> None:
    url = "https://git.example.com/ml/loraplex/-/blob/main/docs/runbooks.md"
    values = {"monitoring": {"prometheusRule": {"enabled": True, "runbookUrl": url}}}
    rule = one(render(values), "PrometheusRule")
    placeholder = "https://loraplex.invalid/docs/runbooks.md"
    want = yaml.safe_load(RULES_FILE.read_text().replace(placeholder, url))["groups"]
    assert rule["spec"]["groups"] == want
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert alerts and all(
        r["annotations"]["runbook_url"] == f"{url}#{r['alert'].lower()}" for r in alerts
    )


def test_dashboard_configmaps() -> None:
    docs = render(ALL_ON)
    cms = by_kind(docs, "ConfigMap")
    assert len(cms) == len(DASHBOARDS)
    found = {}
    for cm in cms:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "loraplex"}
        ((key, text),) = cm["data"].items()
        found[key] = json.loads(text)
    assert found == {p.name: json.loads(p.read_text()) for p in DASHBOARDS}


def test_network_policy() -> None:
    docs = render(SCENARIOS["netpol-only"])
    np = one(docs, "NetworkPolicy")
    spec = np["spec"]
    assert spec["podSelector"] == {"matchLabels": {"app.kubernetes.io/component": "engine"}}
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    # test: the helm test Pod
    operator_peer, gateway_peer, test_peer, prometheus_peer = rule["from"]
    assert test_peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "helm-test"
    gateway = one(docs, "Deployment", f"{FULL}-gateway")
    gateway_labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert gateway_peer["podSelector"]["matchLabels"].items() <= gateway_labels.items()
    dep = operator_deployment(docs)
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert operator_peer["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert operator_peer["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}
    }
    assert prometheus_peer["podSelector"] == {
        "matchLabels": {"app.kubernetes.io/name": "prometheus"}
    }
    extra = {"ipBlock": {"cidr": "10.0.0.0/8"}}
    docs = render({"networkPolicy": {"enabled": True, "extraIngress": [extra]}})
    assert one(docs, "NetworkPolicy")["spec"]["ingress"][0]["from"][-1] == extra


def test_network_policy_egress_is_dns_and_the_reward_peers_when_enabled() -> None:
    assert "egress" not in one(render(SCENARIOS["netpol-only"]), "NetworkPolicy")["spec"]
    reward = {
        "to": [{"namespaceSelector": {"matchLabels": {"team": "a"}}}],
        "ports": [{"port": 8080}],
    }
    values = {
        "networkPolicy": {"enabled": True, "egress": {"enabled": True, "rewardPeers": [reward]}}
    }
    spec = one(render(values), "NetworkPolicy")["spec"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    dns, rewards = spec["egress"]
    assert dns["to"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
        }
    ]
    assert sorted(p["protocol"] for p in dns["ports"]) == ["TCP", "UDP"]
    assert {p["port"] for p in dns["ports"]} == {53}
    assert rewards == reward
    assert len(spec["ingress"]) == 1  # ingress unchanged: operator and Prometheus only


def test_notes() -> None:
    notes = render_notes()
    assert "kubectl get lx -A" in notes
    assert "every namespace" in notes
    assert f"{FULL}-engine-token" in notes
    notes = render_notes({**SCENARIOS["namespaced"], **ALL_ON})
    assert "team-a,team-b" in notes
    assert "loraplex / Fleet" in notes
    assert "NetworkPolicy" in notes


def test_kubernetes_older_than_supported_is_refused() -> None:
    proc = subprocess.run(
        [str(tool("helm")), "template", "x", str(CHART), "--kube-version", "1.28.0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "chart requires kubeVersion: >=1.29.0-0" in proc.stderr, proc.stderr
