"""A spec's string params (``task.params``, ``task.environment.params``): bounded in
count, name length, value length and size, so that a tenant's params cost the engine,
its plug-in worker and every error message that names one a bounded amount.

The CRD carries the count, the value length and the name length (a CEL rule: OpenAPI
has no bound for a map's keys); the serialized size is the engine's alone (CEL cannot
sum a map), checked at PUT. A message echoing a param's name or value shows a prefix
of it (echo.clip).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

from loraplex_engine.spec.schema import FieldRule

MAX_PARAMS = 64
MAX_NAME_CHARS = 128  # an identifier's room, with some
MAX_VALUE_CHARS = 4096
# The params as JSON (what travels to a plug-in worker on every call): 16 values at the
# value limit, or many short ones; well under the 64 x 4 KiB the other bounds allow.
MAX_PARAMS_BYTES = 65536


def _names_fit(params: Mapping[str, str]) -> bool:
    return all(1 <= len(name) <= MAX_NAME_CHARS for name in params)


def _size_fits(params: dict[str, str]) -> dict[str, str]:
    size = len(json.dumps(params, ensure_ascii=False).encode())
    if size > MAX_PARAMS_BYTES:
        raise PydanticCustomError(
            "params_size",
            "the params take {size} bytes as JSON, more than the limit of {limit}",
            {"size": size, "limit": MAX_PARAMS_BYTES},
        )
    return params


ParamValue = Annotated[str, Field(max_length=MAX_VALUE_CHARS)]


def params_type(where: str) -> Any:
    """The params type of the spec field ``where`` (its rule's message names it)."""
    names_rule = FieldRule(
        f"self.all(k, size(k) >= 1 && size(k) <= {MAX_NAME_CHARS})",
        f"{where} names must be 1 to {MAX_NAME_CHARS} characters",
        _names_fit,
    )
    return Annotated[
        dict[str, ParamValue], Field(max_length=MAX_PARAMS), names_rule, AfterValidator(_size_fits)
    ]


TaskParams = params_type("task.params")
EnvironmentParams = params_type("task.environment.params")

__all__ = [
    "MAX_NAME_CHARS",
    "MAX_PARAMS",
    "MAX_PARAMS_BYTES",
    "EnvironmentParams",
    "ParamValue",
    "TaskParams",
]
