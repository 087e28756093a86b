"""EnginePool ``spec.servedModelNames``: the names clients may call a pool's base model by
(``loraplex-engine serve --served-model-name``), checked as the engine checks them
(``loraplex_engine.base_model.served_names``)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

# A hub id (org/model) or one plain name; no ':' (clients cut a name there for a tag).
SERVED_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$"
ServedName = Annotated[str, Field(max_length=193, pattern=SERVED_NAME)]

SERVED_MODEL_NAMES: Any = Field(
    None,
    alias="servedModelNames",
    max_length=16,
    description="Names clients may call the base model by (Tinker's base_model, e.g. the "
    "hub id 'Qwen/Qwen3-8B' a cookbook recipe names), the first the engines' own; passed "
    "as `serve --served-model-name`. Absent: the model's hub id where its directory says "
    "it (config.json's _name_or_path, or a hub cache snapshot), else the directory's name.",
)
