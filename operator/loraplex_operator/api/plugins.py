"""``EnginePool.spec.plugins``: which installed plug-ins each namespace's experiments may
name (``task.reward``, ``task.environment.name``), set by the pool's admin.

Plug-ins are installed in the engine image for the whole pool, so without an allowlist
every tenant may name every one, another team's included. Each grant gives some
namespaces (like ``priorityClasses[].namespaces``: absent = every namespace) some
plug-ins; a namespace may name the union of its grants. The engines enforce it at PUT
(``serve --allow-plugins``, one flag a grant) and report it on /v1/capacity, which the
pool's ``status.plugins.allowed`` repeats.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from loraplex_operator.api.schema import LIST_SET, ApiModel, Namespace

MAX_GRANTS = 64
MAX_GRANT_NAMESPACES = 256
MAX_GRANT_PLUGINS = 64
# The engine's spec_blocks.plugins.PluginName: an entry point, a skyrl-gym id, verifiers:<module>.
PluginName = Annotated[
    str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
]


class PluginGrant(ApiModel):
    """Plug-ins some namespaces' experiments may name."""

    namespaces: tuple[Namespace, ...] | None = Field(
        None,
        min_length=1,
        max_length=MAX_GRANT_NAMESPACES,
        description="Namespaces this grant is for; absent = every namespace. An empty list "
        "is refused (it would be read both ways).",
        json_schema_extra=LIST_SET,
    )
    rewards: tuple[PluginName, ...] | None = Field(
        None,
        max_length=MAX_GRANT_PLUGINS,
        description="Reward plug-ins they may name in task.reward (built-in rewards are "
        "always allowed).",
        json_schema_extra=LIST_SET,
    )
    environments: tuple[PluginName, ...] | None = Field(
        None,
        max_length=MAX_GRANT_PLUGINS,
        description="Environments they may name in task.environment.name (entry points, "
        "skyrl-gym ids, verifiers:<module>).",
        json_schema_extra=LIST_SET,
    )

    def to_flag(self) -> str:
        """The grant as one `serve --allow-plugins` value, NAMESPACES=KIND:NAME,..."""
        where = ",".join(self.namespaces) if self.namespaces is not None else "*"
        plugins = [f"reward:{n}" for n in self.rewards or ()]
        plugins += [f"environment:{n}" for n in self.environments or ()]
        return f"{where}={','.join(plugins)}"


class PluginAccess(ApiModel):
    """Which installed plug-ins each namespace's experiments may name (spec.plugins)."""

    allowed: tuple[PluginGrant, ...] | None = Field(
        None,
        max_length=MAX_GRANTS,
        description="Grants of plug-ins to namespaces; a namespace may name the plug-ins of "
        "every grant that lists it (or lists no namespaces). Absent = every namespace may "
        "name every installed plug-in; an empty list = none may name any. An experiment "
        "naming a plug-in its namespace is not granted is refused by the engine (a 422 "
        "naming spec.task.reward or spec.task.environment.name and the namespace).",
    )

    def serve_flags(self) -> list[str]:
        """`serve --allow-plugins` flags: one a grant; `*=` (granting nothing) for an
        empty list, which turns the allowlist on all the same."""
        if self.allowed is None:
            return []
        return [f"--allow-plugins={g.to_flag()}" for g in self.allowed or (PluginGrant(),)]


__all__ = ["PluginAccess", "PluginGrant"]
