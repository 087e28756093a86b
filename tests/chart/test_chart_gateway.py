"""The chart's loraplex-gateway: the rendered Deployment's command line parses as the
gateway's real CLI (loraplex_operator.gateway.cli), it runs from the operator image with
2 replicas, a Service and a PodDisruptionBudget, and its RBAC reads key Secrets either
cluster-wide or only in the namespaces listed, and writes nothing."""

from __future__ import annotations

from loraplex_operator.gateway.cli import parser

from tests.support.chart_helpers import SCENARIOS, by_kind, one, render

NAME = "loraplex-gateway"


def _deployment(docs: list[dict]) -> dict:
    [dep] = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == NAME]
    return dep


def test_the_rendered_command_line_is_the_gateways_cli() -> None:
    docs = render({"gateway": {"keys": {"namespaces": ["team-b", "team-a"]}}})
    dep = _deployment(docs)
    [container] = dep["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python", "-m", "loraplex_operator.gateway"]
    args = parser().parse_args(container["args"])
    assert args.port == 8080 and args.key_namespaces == "team-a,team-b"
    assert args.engines_file is None  # the Kubernetes API, never a file, in a cluster
    assert dep["spec"]["replicas"] == 2
    operator = one(docs, "Deployment", "loraplex-operator")
    assert container["image"] == operator["spec"]["template"]["spec"]["containers"][0]["image"]
    service = one(docs, "Service", NAME)
    assert service["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    pdb = one(docs, "PodDisruptionBudget", NAME)
    assert pdb["spec"]["minAvailable"] == 1


def test_key_secrets_are_read_where_the_values_say_and_only_experiments_are_written() -> None:
    cluster = render()
    rules = one(cluster, "ClusterRole", NAME)["rules"]
    assert any(r["resources"] == ["secrets"] for r in rules)
    scoped = render({"gateway": {"keys": {"namespaces": ["team-a"]}}})
    rules = one(scoped, "ClusterRole", NAME)["rules"]
    assert not any("secrets" in r["resources"] for r in rules)
    roles = [r for r in by_kind(scoped, "Role") if r["metadata"]["name"] == NAME + "-keys"]
    assert [r["metadata"]["namespace"] for r in roles] == ["team-a"]
    for doc in by_kind(scoped, "Role") + by_kind(scoped, "ClusterRole"):
        if doc["metadata"]["name"].startswith(NAME):
            for rule in doc["rules"]:
                if rule["resources"] == ["loraexperiments"]:  # Tinker models (issue 29 item 3)
                    assert set(rule["verbs"]) == {"get", "create", "delete", "patch"}, rule
                else:
                    assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule


def test_engines_admit_the_gateway_under_the_network_policy() -> None:
    docs = render({"networkPolicy": {"enabled": True}})
    policy = by_kind(docs, "NetworkPolicy")[0]
    peers = policy["spec"]["ingress"][0]["from"]
    assert any(
        p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component")
        == "gateway"
        for p in peers
    )
    assert not any(d["metadata"]["name"] == NAME for d in render({"gateway": {"enabled": False}}))


def test_the_gateway_is_on_by_default_and_its_service_monitor_selects_its_service() -> None:
    """`helm install` gives tenants their way in; with monitoring on, Prometheus scrapes
    every gateway pod's /metrics on the Service's port, as job loraplex-gateway, keeping
    the tenant `namespace` label the gateway exports."""
    docs = render(
        {"monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "kps"}}}}
    )
    dep = _deployment(docs)
    service = one(docs, "Service", NAME)
    monitor = one(docs, "ServiceMonitor", NAME)
    assert monitor["metadata"]["labels"]["release"] == "kps"
    selector = monitor["spec"]["selector"]["matchLabels"]
    selected = [
        s for s in by_kind(docs, "Service") if selector.items() <= s["metadata"]["labels"].items()
    ]
    assert selected == [service]
    (endpoint,) = monitor["spec"]["endpoints"]
    [port] = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    [container] = dep["spec"]["template"]["spec"]["containers"]
    assert port["targetPort"] in [p["name"] for p in container["ports"]]
    assert endpoint["path"] == "/metrics" and endpoint["honorLabels"] is True
    assert {"action": "replace", "targetLabel": "job", "replacement": "loraplex-gateway"} in (
        endpoint["relabelings"]
    )
    assert not any(d["metadata"]["name"] == NAME for d in render(SCENARIOS["no-gateway"]))
