"""Offline stand-ins for what the API server does with our CRDs: structural defaults,
OpenAPI validation (jsonschema), pruning of unknown fields, and CEL rules (cel-python).

Known gap: cel-python's `has(self.a.b)` is false when `a` is missing, where the API
server's cel-go raises "no such key"; guard each level (`has(self.a) && has(self.a.b)`).
Plain field reads of a missing key do raise here, as on the server.

Lists with `x-kubernetes-list-type: set` or `map` reach CEL in one canonical order:
the API server compares them without regard to order (`[a, b] == [b, a]`), which is
what a transition rule such as `self == oldSelf` sees when a user reorders a set.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import celpy
import jsonschema
import yaml

from tests.support.paths import REPO_ROOT as REPO  # the name its importers use

CRD_DIR = REPO / "crds"
CRD_FILES = {
    "LoRAExperiment": CRD_DIR / "loraexperiments.yaml",
    "EnginePool": CRD_DIR / "enginepools.yaml",
}


def load_crd(kind: str) -> dict[str, Any]:
    return copy.deepcopy(_parse_yaml(CRD_FILES[kind].read_text()))


@functools.lru_cache(maxsize=8)
def _parse_yaml(text: str) -> dict[str, Any]:
    """Parsed once per file content: the API server stand-in checks every create against
    the CRD, and parsing it takes longer than the check."""
    return yaml.safe_load(text)


def schema_of(kind: str) -> dict[str, Any]:
    return load_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


# --- defaults and pruning --------------------------------------------------------------


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting, top-down as the API server does (returns a new value)."""
    value = copy.deepcopy(value)
    _default_into(schema, value)
    return value


def _default_into(schema: dict[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                _default_into(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in set(value) - set(schema.get("properties", {})):
                _default_into(extra, value[name])
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            _default_into(schema["items"], item)


def unknown_fields(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Fields the API server would prune (or reject under strict field validation)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found: list[str] = []
    if isinstance(value, dict) and schema.get("type") == "object":
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for name, sub in value.items():
            where = f"{path}.{name}" if path else name
            if name in props:
                found += unknown_fields(props[name], sub, where)
            elif isinstance(extra, dict):
                found += unknown_fields(extra, sub, where)
            elif path == "" and name in ("apiVersion", "kind", "metadata"):
                continue
            elif path != "metadata":
                found.append(where)
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += unknown_fields(schema["items"], item, f"{path}[{i}]")
    return found


def list_type_errors(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Duplicates the API server refuses: equal items of an `x-kubernetes-list-type: set`,
    items with equal `x-kubernetes-list-map-keys` in a `map` list (jsonschema has no
    such keyword)."""
    found: list[str] = []
    if isinstance(value, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        for name, sub in value.items():
            sub_schema = props.get(name, extra if isinstance(extra, dict) else None)
            if sub_schema is not None:
                found += list_type_errors(sub_schema, sub, _where(path, name))
    elif isinstance(value, list):
        kind, keys = schema.get("x-kubernetes-list-type"), schema.get("x-kubernetes-list-map-keys")
        ids = [
            json.dumps(item, sort_keys=True)
            if kind == "set"
            else json.dumps([item.get(k) for k in keys])
            for item in value
            if kind == "set" or (kind == "map" and isinstance(item, dict))
        ]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        found += [f"{path}: Duplicate value: {i}" for i in dupes]
        for i, item in enumerate(value):
            found += list_type_errors(schema.get("items", {}), item, f"{path}[{i}]")
    return found


def schema_errors(schema: dict[str, Any], obj: Any) -> list[str]:
    """OpenAPI v3 (draft-4 style: boolean exclusiveMinimum) validation messages."""
    validator = jsonschema.Draft4Validator(schema)
    return sorted(
        f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in validator.iter_errors(obj)
    )


# --- which schema rule fired ------------------------------------------------------------

# The OpenAPI keywords that reject a value (`exclusiveMinimum`/`exclusiveMaximum` are
# draft-4 modifiers of minimum/maximum; `type` and `format` are left out: every field has
# them, and a wrong type is the structural schema's business, not a bound).
CONSTRAINTS = (
    "minimum", "maximum", "enum", "pattern", "minItems", "maxItems",
    "minLength", "maxLength", "minProperties", "maxProperties", "required",
)  # fmt: skip


def _where(path: str, step: str) -> str:
    return f"{path}{step}" if step in ("[]", "{}") else f"{path}.{step}" if path else step


def constraint_rules(schema: dict[str, Any], path: str = "") -> Iterator[str]:
    """Every value rule in a schema as "<field> <keyword>" ("spec.lora.rank maximum",
    "spec.lora.targetModules[] pattern", "spec required:task"); "[]" is an array's items,
    "{}" a map's values, and each required property is a rule of its own."""
    for keyword in CONSTRAINTS:
        if keyword == "required":
            yield from (f"{path or '<root>'} required:{n}" for n in schema.get(keyword, []))
        elif keyword in schema:
            yield f"{path or '<root>'} {keyword}"
    for name, sub in schema.get("properties", {}).items():
        yield from constraint_rules(sub, _where(path, name))
    if "items" in schema:
        yield from constraint_rules(schema["items"], _where(path, "[]"))
    if isinstance(schema.get("additionalProperties"), dict):
        yield from constraint_rules(schema["additionalProperties"], _where(path, "{}"))


_SCHEMA_STEPS = {"items": "[]", "additionalProperties": "{}"}


def broken_rules(schema: dict[str, Any], obj: Any) -> set[str]:
    """The rules of `constraint_rules` that `obj` breaks (same names)."""
    found = set()
    for e in jsonschema.Draft4Validator(schema).iter_errors(obj):
        if e.validator not in CONSTRAINTS:
            continue
        steps, path = list(e.absolute_schema_path)[:-1], ""
        while steps:
            step = steps.pop(0)
            path = _where(path, steps.pop(0) if step == "properties" else _SCHEMA_STEPS[step])
        name = f"required:{e.message.split(chr(39))[1]}" if e.validator == "required" else ""
        found.add(f"{path or '<root>'} {name or e.validator}")
    return found


# --- CEL -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    path: tuple[str, ...]  # property names; "[]" steps into array items
    rule: str
    message: str

    @property
    def is_transition(self) -> bool:
        return "oldSelf" in self.rule


def walk_rules(schema: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[Rule]:
    """Every x-kubernetes-validations rule in a schema, with where it sits."""
    for v in schema.get("x-kubernetes-validations", []):
        yield Rule(path, v["rule"], v.get("message", v["rule"]))
    for name, sub in schema.get("properties", {}).items():
        yield from walk_rules(sub, (*path, name))
    if "items" in schema:
        yield from walk_rules(schema["items"], (*path, "[]"))
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk_rules(schema["additionalProperties"], (*path, "{}"))


def to_cel(schema: dict[str, Any], value: Any) -> Any:
    """JSON → CEL values as the API server types them (`number` is always a double)."""
    t = schema.get("type")
    if value is None:
        return None
    if t == "number":
        return celpy.celtypes.DoubleType(float(value))
    if t == "integer":
        return celpy.celtypes.IntType(int(value))
    if t == "boolean":
        return celpy.celtypes.BoolType(value)
    if t == "string":
        return celpy.celtypes.StringType(value)
    if isinstance(value, list):
        items = schema.get("items", {})
        if schema.get("x-kubernetes-list-type") in ("set", "map"):
            value = sorted(value, key=lambda v: json.dumps(v, sort_keys=True))
        return celpy.celtypes.ListType([to_cel(items, v) for v in value])
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = (
            schema.get("additionalProperties")
            if isinstance(schema.get("additionalProperties"), dict)
            else {}
        )
        return celpy.celtypes.MapType(
            {celpy.celtypes.StringType(k): to_cel(props.get(k, extra), v) for k, v in value.items()}
        )
    return celpy.json_to_cel(value)


_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def _program(rule: str) -> Any:
    if rule not in _PROGRAMS:
        _PROGRAMS[rule] = _ENV.program(_ENV.compile(rule))
    return _PROGRAMS[rule]


def eval_rule(rule: str, schema: dict[str, Any], value: Any, old: Any = None) -> bool:
    activation = {"self": to_cel(schema, value)}
    if old is not None:
        activation["oldSelf"] = to_cel(schema, old)
    result = _program(rule).evaluate(activation)
    if isinstance(result, Exception):
        raise RuntimeError(f"CEL rule {rule!r} failed to evaluate: {result}")
    return bool(result)


def _nodes(schema: dict[str, Any], value: Any, path: tuple[str, ...]) -> Iterator[tuple[dict, Any]]:
    """(schema, value) pairs at `path` inside `value` (arrays fan out)."""
    if not path:
        yield schema, value
        return
    step, rest = path[0], path[1:]
    if step == "[]":
        for item in value if isinstance(value, list) else ():
            yield from _nodes(schema["items"], item, rest)
    elif step == "{}":
        for item in (value or {}).values() if isinstance(value, dict) else ():
            yield from _nodes(schema["additionalProperties"], item, rest)
    elif isinstance(value, dict) and step in value:
        yield from _nodes(schema["properties"][step], value[step], rest)


def _at(value: Any, path: tuple[str, ...]) -> Any:
    for step in path:
        if not isinstance(value, dict) or step not in value:
            return None
        value = value[step]
    return value


def cel_errors(schema: dict[str, Any], obj: Any, old: Any = None) -> list[str]:
    """Messages of the CEL rules `obj` breaks (transition rules only when `old` is given).

    Like the API server: a transition rule runs only where the old object had the field
    too; rules under arrays are not correlated with old items (we have none).
    """
    failed: list[str] = []
    for rule in walk_rules(schema):
        if rule.is_transition:
            if old is None or "[]" in rule.path or "{}" in rule.path:
                continue
            new_v, old_v = _at(obj, rule.path), _at(old, rule.path)
            if new_v is None or old_v is None:
                continue
            sub = next(_nodes(schema, obj, rule.path))[0]
            if not eval_rule(rule.rule, sub, new_v, old_v):
                failed.append(rule.message)
            continue
        for sub, value in _nodes(schema, obj, rule.path):
            if not eval_rule(rule.rule, sub, value):
                failed.append(rule.message)
    return failed


def admit(kind: str, obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """Everything the API server would say about creating (or updating to) `obj`."""
    schema = schema_of(kind)
    full = apply_defaults(schema, obj)
    old_full = apply_defaults(schema, old) if old is not None else None
    errors = schema_errors(schema, full)
    errors += [f"unknown field {f}" for f in unknown_fields(schema, full)]
    errors += list_type_errors(schema, full)
    if not errors:  # the API server runs CEL only on schema-valid objects
        errors += cel_errors(schema, full, old_full)
    return errors
