"""values.schema.json (and templates/validate.yaml) reject bad values with clear messages."""

from __future__ import annotations

import json

import pytest

from tests.support.chart_helpers import CHART, render, render_error

BAD_VALUES = {
    "unknown top-level key": (
        {"operatr": {}},
        "Additional property operatr is not allowed",
    ),
    "typo inside operator": (
        {"operator": {"imagee": {"repository": "x"}}},
        "operator: Additional property imagee is not allowed",
    ),
    "rbac scope not an option": (
        {"rbac": {"scope": "global"}},
        'rbac.scope: rbac.scope must be one of the following: "cluster", "namespaced"',
    ),
    "namespaced without namespaces": (
        {"rbac": {"scope": "namespaced"}},
        "rbac.namespaces: Array must have at least 1 items",
    ),
    "namespaces given in cluster mode": (
        {"rbac": {"namespaces": ["team-a"]}},
        "rbac.namespaces: Array must have at most 0 items",
    ),
    "namespace not a DNS label": (
        {"rbac": {"scope": "namespaced", "namespaces": ["Team_A"]}},
        "rbac.namespaces.0: Does not match pattern",
    ),
    "privileged health port": (
        {"operator": {"ports": {"health": 80}}},
        "operator.ports.health: Must be greater than or equal to 1024",
    ),
    "metrics port a string": (
        {"operator": {"ports": {"metrics": "8080"}}},
        "operator.ports.metrics: Invalid type. Expected: integer, given: string",
    ),
    "log level": (
        {"operator": {"logLevel": "loud"}},
        "operator.logLevel: operator.logLevel must be one of the following",
    ),
    "image digest": (
        {"operator": {"image": {"digest": "latest"}}},
        "operator.image.digest: Does not match pattern",
    ),
    "scrape interval without unit": (
        {"monitoring": {"podMonitor": {"enabled": True, "interval": "30"}}},
        "monitoring.podMonitor.interval: Does not match pattern",
    ),
    "engine log format": (
        {"engines": {"logFormat": "xml"}},
        "engines.logFormat: engines.logFormat must be one of the following",
    ),
    "stall after zero seconds": (
        {"engines": {"stallAfterSeconds": 0}},
        "engines.stallAfterSeconds: Must be greater than or equal to 1",
    ),
    "stall after as a duration string": (
        {"engines": {"stallAfterSeconds": "10m"}},
        "engines.stallAfterSeconds: Invalid type. Expected: integer, given: string",
    ),
    "short token": (
        {"engines": {"token": {"length": 8}}},
        "engines.token.length: Must be greater than or equal to 32",
    ),
    "empty engine selector": (
        # null deletes the default key (Helm merges maps)
        {"engines": {"selector": {"app.kubernetes.io/component": None}}},
        "engines.selector: Must have at least 1 properties",
    ),
    "pool name too long": (
        {"defaultPool": {"enabled": True, "name": "p" * 41}},
        "defaultPool.name: String length must be less than or equal to 40",
    ),
    "pool base model not absolute": (
        {"defaultPool": {"enabled": True, "spec": {"baseModel": "models/qwen"}}},
        "defaultPool.spec.baseModel: Does not match pattern '^/'",
    ),
    "pool with more ranks than a node has GPUs": (
        {"defaultPool": {"enabled": True, "spec": {"gpusPerEngine": 9}}},
        "defaultPool.spec.gpusPerEngine: Must be less than or equal to 8",
    ),
    "pool sharding its base over one rank": (
        {"defaultPool": {"enabled": True, "spec": {"shardBase": True}}},
        "defaultPool.spec.gpusPerEngine: Must be greater than or equal to 2",
    ),
    "pool shardBase not a boolean": (
        {"defaultPool": {"enabled": True, "spec": {"gpusPerEngine": 2, "shardBase": "yes"}}},
        "defaultPool.spec.shardBase: Invalid type. Expected: boolean, given: string",
    ),
    "pool with empty image": (
        {"defaultPool": {"enabled": True, "spec": {"template": {"image": ""}}}},
        "defaultPool.spec.template.image: String length must be greater than or equal to 1",
    ),
    "dashboards labels not strings": (
        {"monitoring": {"dashboards": {"labels": {"grafana_dashboard": 1}}}},
        "monitoring.dashboards.labels.grafana_dashboard: Invalid type. Expected: string",
    ),
    "runbook url with a fragment": (
        {"monitoring": {"prometheusRule": {"runbookUrl": "https://docs.example/runbooks.md#x"}}},
        "monitoring.prometheusRule.runbookUrl: Does not match pattern",
    ),
    # Checks across values (templates/validate.yaml, servicemonitor.yaml):
    "metrics and health on one port": (
        {"operator": {"ports": {"metrics": 8080, "health": 8080}}},
        "operator.ports.metrics and operator.ports.health must differ (both are 8080)",
    ),
    "pool engine namespace differs": (
        {"defaultPool": {"enabled": True, "spec": {"engineNamespace": "elsewhere"}}},
        "defaultPool.spec.engineNamespace (elsewhere) differs from the chart's engine namespace",
    ),
    "service monitor without service": (
        {
            "monitoring": {"serviceMonitor": {"enabled": True}},
            "metrics": {"service": {"enabled": False}},
        },
        "monitoring.serviceMonitor.enabled needs metrics.service.enabled",
    ),
    "no service account to use": (
        {"serviceAccount": {"create": False}},
        "serviceAccount.name is required when serviceAccount.create is false",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_values_rejected(case: str) -> None:
    values, message = BAD_VALUES[case]
    err = render_error(values)
    assert message in err, f"{case}: expected {message!r} in:\n{err}"


def test_schema_is_strict_everywhere() -> None:
    """Every object in the schema that lists properties also forbids unknown ones
    (except pass-through objects: the pool spec, which the CRD validates)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    loose = []

    def walk(node: dict, path: str) -> None:
        if node.get("type") == "object" and "properties" in node:
            passthrough = path.startswith("defaultPool.spec")
            if node.get("additionalProperties") is not False and not passthrough:
                loose.append(path)
            for key, sub in node["properties"].items():
                walk(sub, f"{path}.{key}".lstrip("."))

    walk(schema, "")
    assert not loose, f"objects accepting unknown keys: {loose}"


def test_good_values_accepted() -> None:
    docs = render(
        {
            "rbac": {"scope": "namespaced", "namespaces": ["team-a"]},
            "operator": {"ports": {"metrics": 9090, "health": 9091}, "logLevel": "quiet"},
            "monitoring": {"podMonitor": {"enabled": True, "interval": "1m30s"}},
            "defaultPool": {"enabled": True, "name": "a" * 40},
        }
    )
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "PodMonitor", "EnginePool", "Role"} <= kinds
    (pool,) = [d for d in docs if d["kind"] == "EnginePool"]
    assert pool["metadata"]["name"] == "a" * 40
