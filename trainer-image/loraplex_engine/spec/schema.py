"""What the spec models carry so that the CRD's schema can be generated from them.

The pydantic models in ``spec/experiment.py`` are the one source of the ``LoRAExperiment`` spec
schema; ``scripts/gen_crds.py`` turns their JSON Schema into the CRD's OpenAPI schema.
Plain field constraints (bounds, lengths, patterns, enums) translate directly; this
module adds what JSON Schema has no word for, each stated once and read by both sides:

- ``CelRule``: a cross-field rule, written as CEL for the API server and as a Python
  check that ``parse_spec`` runs (the engine and ``loraplex-engine run`` see no CRD);
- ``FieldRule``: the same for one field's own value, the rule sitting on that field;
- ``ListSet``: a list of distinct items (``x-kubernetes-list-type: set``), checked here too;
- ``ListMap``: a list of objects with distinct keys (``x-kubernetes-list-type: map``);
- ``Int32``/``Int64``: the integer format the CRD declares;
- ``spec_errors``: pydantic's errors as ``SpecError``s naming the field;
- ``immutable``: a transition rule (``self == oldSelf``); only the API server can check it,
  since a spec alone has no old value (the engine's analogue is 409 on a changed spec).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    ValidationError,
    model_validator,
)
from pydantic_core import CoreSchema, PydanticCustomError, core_schema

from loraplex_engine.spec.echo import clip
from loraplex_engine.spec.errors import SpecError

CEL_KEY = "x-kubernetes-validations"


@dataclass(frozen=True)
class CelRule:
    """One rule, two spellings: ``cel`` for the CRD (``self`` is the model's object, after
    the API server's defaulting) and ``holds`` for pydantic (the validated model)."""

    cel: str
    message: str
    field: str  # where parse_spec reports a violation, relative to the model
    holds: Callable[[Any], bool]

    def as_crd(self) -> dict[str, str]:
        return {"rule": self.cel, "message": self.message}


def _add_cel_rules(schema: dict[str, Any], cls: type) -> None:
    rules = getattr(cls, "CEL_RULES", ())
    if rules:
        schema[CEL_KEY] = [r.as_crd() for r in rules]


class SpecModel(BaseModel):
    """Base of the spec models: strict, closed, frozen, and checking its ``CEL_RULES``."""

    # strict: no "8" → 8 coercion, as the CRD's OpenAPI types would reject it too.
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        allow_inf_nan=False,
        strict=True,
        json_schema_extra=_add_cel_rules,
    )
    CEL_RULES: ClassVar[tuple[CelRule, ...]] = ()

    @model_validator(mode="after")
    def _check_cel_rules(self) -> SpecModel:
        for rule in self.CEL_RULES:
            if not rule.holds(self):
                # ctx["field"] lets parse_spec name the field, not just the block.
                raise PydanticCustomError("cross_field", rule.message, {"field": rule.field})
        return self


@dataclass(frozen=True)
class FieldRule:
    """A rule on one field's value (``self`` is the value), as CEL on that field and as a
    Python check. On the field, not its parent: the API server's validation ratcheting
    (1.30+) then lets a stored value that broke a newer rule through unrelated updates."""

    cel: str
    message: str
    holds: Callable[[Any], bool]

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> dict[str, Any]:
        return {**handler(schema), CEL_KEY: [{"rule": self.cel, "message": self.message}]}

    def _check(self, value: Any) -> Any:
        if not self.holds(value):
            raise PydanticCustomError("field_rule", self.message)
        return value


def immutable(message: str) -> dict[str, Any]:
    """``json_schema_extra`` of a field the API server refuses to change after create."""
    return {CEL_KEY: [{"rule": "self == oldSelf", "message": message}]}


def block(model: type[SpecModel], description: str, immutable_message: str | None = None) -> Any:
    """A nested block that defaults to ``{}`` (every field at its default)."""
    extra: dict[str, Any] = {"default": {}}
    if immutable_message:
        extra |= immutable(immutable_message)
    return Field(default_factory=model, description=description, json_schema_extra=extra)


class ListSet:
    """A list whose items are distinct, like the API server's ``x-kubernetes-list-type: set``."""

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        return core_schema.no_info_after_validator_function(_distinct, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> dict[str, Any]:
        return {**handler(schema), "x-kubernetes-list-type": "set"}


def _distinct(items: list[Any]) -> list[Any]:
    seen: set[Any] = set()
    for item in items:
        if item in seen:
            raise PydanticCustomError(
                "duplicate_item", "items must be distinct (a set): {item} is listed twice",
                {"item": repr(item)},
            )  # fmt: skip
        seen.add(item)
    return items


@dataclass(frozen=True)
class ListMap:
    """A list of objects keyed by ``key`` (``x-kubernetes-list-type: map``): the API
    server merges entries by it and refuses two with one key; checked here too."""

    key: str

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        return core_schema.no_info_after_validator_function(self._distinct, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> dict[str, Any]:
        keys = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": [self.key]}
        return {**handler(schema), **keys}

    def _distinct(self, items: list[Any]) -> list[Any]:
        _distinct([getattr(item, self.key) for item in items])
        return items


@dataclass(frozen=True)
class _Format:
    """The OpenAPI ``format`` an integer has in the CRD (JSON Schema has no int32)."""

    name: str

    def __get_pydantic_json_schema__(
        self, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> dict[str, Any]:
        return {**handler(schema), "format": self.name}


def _field_path(err: Mapping[str, Any], prefix: str) -> str:
    # A map's key is part of the path (task.params.<name>): a tenant's, so clipped.
    loc = [clip(str(part)) for part in err.get("loc", ())]
    extra = (err.get("ctx") or {}).get("field")
    if extra:
        loc.append(str(extra))
    return ".".join([prefix, *loc]) if loc else prefix


def _message(err: Mapping[str, Any]) -> str:
    return "unknown field" if err["type"] == "extra_forbidden" else str(err["msg"])


def spec_errors(exc: ValidationError, prefix: str = "spec") -> list[SpecError]:
    """Every pydantic error as a ``SpecError`` (for messages that list them all)."""
    return [SpecError(_field_path(e, prefix), _message(e)) for e in exc.errors()]


Int32 = Annotated[int, _Format("int32")]
Int64 = Annotated[int, _Format("int64")]

__all__ = [
    "CEL_KEY",
    "CelRule",
    "FieldRule",
    "Int32",
    "Int64",
    "ListMap",
    "ListSet",
    "SpecModel",
    "block",
    "immutable",
    "spec_errors",
]
