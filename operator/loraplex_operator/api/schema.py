"""What the API models carry so that a CRD schema can be generated from them.

Plain pydantic constraints (bounds, lengths, patterns, enums, defaults, descriptions)
translate to OpenAPI directly (``scripts/gen_crds.py``); this module adds the words
JSON Schema lacks, as the ``x-kubernetes-*`` keys the generator passes through. The
engine's ``spec/schema.py`` does the same for the experiment spec; the operator image
has no engine package, so the two small sets of helpers are kept side by side.

The API server validates a pool before the operator ever reads it, so the models here
check nothing the CRD does not: CEL rules are the server's alone, and reading is lax
(unknown fields ignored, so an object written by a newer CRD still reads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, GetJsonSchemaHandler

CEL_KEY = "x-kubernetes-validations"
# A DNS label, as Kubernetes names a namespace.
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
Namespace = Annotated[str, Field(min_length=1, max_length=63, pattern=DNS_LABEL)]
PRESERVE_UNKNOWN = {"x-kubernetes-preserve-unknown-fields": True}
LIST_SET = {"x-kubernetes-list-type": "set"}


@dataclass(frozen=True)
class Cel:
    """A cross-field rule, checked by the API server (``self`` is the model's object)."""

    rule: str
    message: str

    def as_crd(self) -> dict[str, str]:
        return {"rule": self.rule, "message": self.message}


def _add_cel_rules(schema: dict[str, Any], cls: type) -> None:
    rules = getattr(cls, "CEL_RULES", ())
    if rules:
        schema[CEL_KEY] = [r.as_crd() for r in rules]


class ApiModel(BaseModel):
    """Base of the API models: frozen, camelCase on the wire, snake_case in Python."""

    model_config = ConfigDict(
        frozen=True,
        extra="ignore",
        validate_by_name=True,
        validate_by_alias=True,
        json_schema_extra=_add_cel_rules,
    )
    CEL_RULES: ClassVar[tuple[Cel, ...]] = ()

    def to_json(self) -> dict[str, Any]:
        """camelCase dict as the API server stores it (absent = None, left out)."""
        return self.model_dump(by_alias=True, mode="json", exclude_none=True)


class OpenModel(ApiModel):
    """A core/v1-shaped object of which only some fields are typed; the API server keeps
    the rest as written (``x-kubernetes-preserve-unknown-fields``) and so does the model."""

    model_config = ConfigDict(extra="allow")


def immutable(message: str) -> dict[str, Any]:
    """``json_schema_extra`` of a field the API server refuses to change after create."""
    return {CEL_KEY: [{"rule": "self == oldSelf", "message": message}]}


def list_map(*keys: str) -> dict[str, Any]:
    """``json_schema_extra`` of a list the API server merges by ``keys``."""
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": list(keys)}


def block(model: type[ApiModel], description: str) -> Any:
    """A nested block that defaults to ``{}`` (every field at its default)."""
    return Field(default_factory=model, description=description, json_schema_extra={"default": {}})


@dataclass(frozen=True)
class _Format:
    """The OpenAPI ``format`` a value has in the CRD (JSON Schema has no int32)."""

    name: str

    def __get_pydantic_json_schema__(
        self, schema: Any, handler: GetJsonSchemaHandler
    ) -> dict[str, Any]:
        return {**handler(schema), "format": self.name}


Int32 = Annotated[int, _Format("int32")]
Int64 = Annotated[int, _Format("int64")]
# RFC 3339 as the API server writes it; kept a string so a status round-trips unchanged.
DateTime = Annotated[str, _Format("date-time")]

__all__ = [
    "CEL_KEY",
    "DNS_LABEL",
    "LIST_SET",
    "PRESERVE_UNKNOWN",
    "ApiModel",
    "Cel",
    "DateTime",
    "Int32",
    "Int64",
    "Namespace",
    "OpenModel",
    "block",
    "immutable",
    "list_map",
]
