"""Every property of both CRDs says what it is: `kubectl explain` prints these
descriptions, and they are the reference a user reads. The LoRAExperiment spec's come
from the pydantic models (Field(description=...)), the rest are written in the CRDs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.crdkit import CRD_FILES, schema_of


def undocumented(schema: dict[str, Any], path: str = "") -> Iterator[str]:
    """Properties (at any depth, in array items and map values too) without a description."""
    for name, sub in schema.get("properties", {}).items():
        where = f"{path}.{name}" if path else name
        # Root metadata is ObjectMeta: kubectl explain shows its own description, and the
        # API server allows nothing but `type: object` there (test_crd_schema checks).
        if where != "metadata" and not str(sub.get("description", "")).strip():
            yield where
        yield from undocumented(sub, where)
    if isinstance(schema.get("items"), dict):
        yield from undocumented(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from undocumented(schema["additionalProperties"], f"{path}{{}}")


@pytest.mark.parametrize("kind", sorted(CRD_FILES))
def test_every_property_has_a_description(kind: str) -> None:
    assert list(undocumented(schema_of(kind))) == []


@pytest.mark.parametrize("kind", sorted(CRD_FILES))
def test_the_kind_has_a_description(kind: str) -> None:
    assert len(schema_of(kind).get("description", "")) > 40


def test_the_walker_finds_nested_gaps() -> None:
    schema = {
        "properties": {
            "metadata": {"type": "object"},
            "spec": {
                "description": "d",
                "properties": {
                    "a": {"type": "array", "items": {"properties": {"b": {"type": "string"}}}},
                    "m": {"description": "d", "additionalProperties": {"properties": {"c": {}}}},
                },
            },
        }
    }
    assert list(undocumented(schema)) == ["spec.a", "spec.a[].b", "spec.m{}.c"]
