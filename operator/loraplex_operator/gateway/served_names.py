"""The names a pool's engines take for their base model, as the gateway routes by them: the
pool's ``servedModelNames`` (``serve --served-model-name``), else what ``serve`` defaults
to that the path alone tells (a hub cache snapshot's ``org/model``), and always the
``baseModel`` directory's own name, which the engines also take. The engine's default
from the model's ``config.json`` (its ``_name_or_path``) is in the image, out of the
gateway's sight: a pool that relies on it names it in ``servedModelNames``."""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from loraplex_operator.api.pool import EnginePoolSpec

_HUB_CACHE_REPO = re.compile(r"models--([^/]+?)--([^/]+)")


def hub_id_of_path(path: str) -> str | None:
    """``org/model`` of a hub cache snapshot path (``.../models--org--model/snapshots/rev``)."""
    p = PurePosixPath(path)
    repo = _HUB_CACHE_REPO.fullmatch(p.parent.parent.name)
    if p.parent.name == "snapshots" and repo is not None:
        return f"{repo.group(1)}/{repo.group(2)}"
    return None


def names_of(spec: EnginePoolSpec) -> tuple[str, ...]:
    """The pool's names for its base model, the engines' own first."""
    directory = PurePosixPath(spec.base_model).name
    given = tuple(spec.served_model_names or ())
    own = given or tuple(n for n in (hub_id_of_path(spec.base_model),) if n)
    return tuple(dict.fromkeys((*own, directory)))
