"""The experiment spec's ``tracking`` block: what its tenant calls its runs in the pool's
experiment trackers (MLflow, Weights & Biases, TensorBoard; loraplex_engine/tracking/).

A tenant names its run and tags it, nothing more: where the runs go (tracker URIs,
credentials, projects) is the pool's choice (``serve --tracking-*``), the run itself is
the engine's (one per experiment run, never one a tenant names), and the namespace,
experiment and run id are system tags a tenant cannot set or override. Both names are
bounded and plain: a tag name has no dot, so it can never be a tracker's own reserved
tag (``mlflow.*``, ``loraplex.*``), and no value carries a control character.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from loraplex_engine.spec.schema import SpecModel

MAX_TAGS = 32
# Letters and digits first, then a few separators; no space, slash or quote.
RunName = Annotated[
    str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._=+,-]*$")
]
TagName = Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*$")]
TagValue = Annotated[str, Field(max_length=256, pattern=r"^[^\x00-\x1f\x7f]*$")]


class Tag(SpecModel):
    """One tag of the experiment's tracked runs."""

    name: TagName = Field(
        description="Tag name: letters, digits, '_' and '-' (no '.': names with a dot are "
        "the trackers' and loraplex's own), at most 63 characters."
    )
    value: TagValue = Field("", description="Tag value, at most 256 characters.")


class TrackingSpec(SpecModel):
    """How the experiment's runs are named and tagged in the experiment trackers its pool
    records to (the EnginePool's spec.tracking; none there: nothing is recorded). Mutable,
    like checkpoint: the next placement on an engine takes it."""

    run_name: RunName | None = Field(
        None,
        alias="runName",
        description="Display name of the run (letters, digits and . _ = + , -; at most 128). "
        "Absent: the experiment's name.",
    )
    tags: Annotated[list[Tag], Field(max_length=MAX_TAGS)] = Field(
        default_factory=list,
        description="Tags of the run, each a name and a value (at most 32, names unique). The "
        "engine adds loraplex.namespace, loraplex.experiment and loraplex.runId itself.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )

    @field_validator("tags")
    @classmethod
    def _unique_names(cls, tags: list[Tag]) -> list[Tag]:
        # The API server checks this too (a list map keyed by name).
        names = [t.name for t in tags]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"tag names must be unique; given twice: {', '.join(twice)}")
        return tags

    def tag_map(self) -> dict[str, str]:
        """The tags as a mapping."""
        return {t.name: t.value for t in self.tags}
