"""Rendered manifests are valid Kubernetes objects.

Built-in kinds: kubernetes-validate --strict (no unknown fields) against the oldest and
the newest Kubernetes version the chart supports. Custom resources: the monitoring.coreos.com
kinds against a subset of the Prometheus Operator's schema (the fields this chart sets;
unknown fields rejected), EnginePool against the CRD's openAPIV3Schema once crds/ exists.
"""

from __future__ import annotations

import jsonschema
import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml

from tests.support.chart_helpers import (
    CUSTOM_KINDS,
    KUBE_VERSIONS,
    SCENARIOS,
    by_kind,
    crd_files,
    operator_deployment,
    render,
)


def test_supported_versions_are_shipped() -> None:
    shipped = set(kubernetes_validate.utils.all_versions())
    for version in KUBE_VERSIONS:
        assert version in shipped, (version, sorted(shipped))
    newest = kubernetes_validate.latest_version()
    assert KUBE_VERSIONS[-1] == newest, f"kubernetes-validate now ships {newest}: validate it"


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_builtin_kinds_validate_strict(scenario: str, kube_version: str) -> None:
    docs = render(SCENARIOS[scenario], kube_version=kube_version, include_crds=True)
    checked = 0
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, kube_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} ({kube_version}): {e.message}")
        checked += 1
    assert checked >= 2  # at least the Deployment and the Secret


def test_validator_rejects_unknown_fields() -> None:
    """Guard: strict validation is not a silent no-op."""
    dep = operator_deployment(render())
    dep["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, KUBE_VERSIONS[0], strict=True)


DURATION = {
    "type": "string",
    "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?"
    "(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
STRMAP = {"type": "object", "additionalProperties": {"type": "string"}}
META = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "namespace": {"type": "string"},
        "labels": STRMAP,
        "annotations": STRMAP,
    },
    "additionalProperties": False,
}
LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": STRMAP,
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["key", "operator"],
                "additionalProperties": False,
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "action": {
            "enum": [
                "replace",
                "keep",
                "drop",
                "hashmod",
                "labelmap",
                "labeldrop",
                "labelkeep",
                "lowercase",
                "uppercase",
                "keepequal",
                "dropequal",
            ]
        },
        "sourceLabels": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"},
        },
        "targetLabel": {"type": "string"},
        "replacement": {"type": "string"},
        "regex": {"type": "string"},
        "separator": {"type": "string"},
    },
}
ENDPOINT_PROPS = {
    "port": {"type": "string"},
    "path": {"type": "string"},
    "interval": DURATION,
    "scrapeTimeout": DURATION,
    "honorLabels": {"type": "boolean"},
    "relabelings": {"type": "array", "items": RELABEL},
    # SafeAuthorization: a bearer token from a Secret in the monitor's namespace.
    "authorization": {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "type": {"type": "string"},
            "credentials": {
                "type": "object",
                "required": ["key"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "key": {"type": "string", "minLength": 1},
                    "optional": {"type": "boolean"},
                },
            },
        },
    },
}
NS_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "any": {"type": "boolean"},
        "matchNames": {"type": "array", "items": {"type": "string"}},
    },
}


def _cr(api_version: str, kind: str, spec: dict) -> dict:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": META,
            "spec": spec,
        },
    }


MONITORING_SCHEMAS = {
    "ServiceMonitor": _cr(
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
        {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": LABEL_SELECTOR,
                "namespaceSelector": NS_SELECTOR,
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": ENDPOINT_PROPS,
                    },
                },
            },
        },
    ),
    "PodMonitor": _cr(
        "monitoring.coreos.com/v1",
        "PodMonitor",
        {
            "type": "object",
            "required": ["selector", "podMetricsEndpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": LABEL_SELECTOR,
                "namespaceSelector": NS_SELECTOR,
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": ENDPOINT_PROPS,
                    },
                },
            },
        },
    ),
    "PrometheusRule": _cr(
        "monitoring.coreos.com/v1",
        "PrometheusRule",
        {
            "type": "object",
            "required": ["groups"],
            "additionalProperties": False,
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["name", "rules"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": DURATION,
                            "rules": {
                                "type": "array",
                                "minItems": 1,
                                "items": {
                                    "type": "object",
                                    "required": ["expr"],
                                    "additionalProperties": False,
                                    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                                    "properties": {
                                        "alert": {"type": "string"},
                                        "record": {"type": "string"},
                                        "expr": {"type": ["string", "integer"]},
                                        "for": DURATION,
                                        "keep_firing_for": DURATION,
                                        "labels": STRMAP,
                                        "annotations": STRMAP,
                                    },
                                },
                            },
                        },
                    },
                }
            },
        },
    ),
}


@pytest.mark.parametrize("scenario", ["all-on", "namespaced-all-on", "engines-elsewhere"])
def test_monitoring_resources_structure(scenario: str) -> None:
    docs = render(SCENARIOS[scenario])
    for kind, schema in MONITORING_SCHEMAS.items():
        found = by_kind(docs, kind)
        # a ServiceMonitor for the operator and one for the gateway; one of the others
        assert len(found) == (2 if kind == "ServiceMonitor" else 1), (kind, len(found))
        for doc in found:
            errors = [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(doc)]
            assert errors == [], (kind, doc["metadata"]["name"], errors)


def _crd_schema(kind: str) -> dict | None:
    for path in crd_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if (
                doc
                and doc.get("kind") == "CustomResourceDefinition"
                and doc["spec"]["names"]["kind"] == kind
            ):
                (version,) = [v for v in doc["spec"]["versions"] if v.get("storage")]
                return version["schema"]["openAPIV3Schema"]
    return None


def test_default_pool_structure() -> None:
    (pool,) = by_kind(render(SCENARIOS["pool-only"]), "EnginePool")
    assert pool["apiVersion"] == "loraplex.dev/v1alpha1"
    assert set(pool) == {"apiVersion", "kind", "metadata", "spec"}
    schema = _crd_schema("EnginePool")
    if schema is None:
        pytest.skip("crds/ has no EnginePool CRD yet: validated against it once the CRDs land")
    jsonschema.validate(pool, schema)
