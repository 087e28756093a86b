"""Which installed plug-ins each namespace may name: the pool admin's allowlist
(``EnginePool.spec.plugins.allowed``, passed as ``serve --allow-plugins``).

Plug-ins are installed in the engine image for the whole pool; one team's reward or
environment may read that team's secrets, call its services or encode its grading, so
the admin may grant each plug-in to some namespaces only. No grant given: every
namespace may name every installed plug-in (as before the allowlist existed). Grants
given: a namespace may name only what some grant lists for it (or for every namespace).
Built-in rewards are not plug-ins and are always allowed.

One ``--allow-plugins`` value is one grant, ``NAMESPACES=PLUGINS``: ``*`` or namespaces
separated by ``,``; then ``KIND:NAME`` entries separated by ``,`` (``reward:acme-format``,
``environment:verifiers:guess``), possibly none (``*=``: the allowlist is on, and this
grant gives nothing).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loraplex_engine.spec.errors import UsageError

if TYPE_CHECKING:
    from loraplex_engine.plugins.discovery import Installed

KINDS = ("reward", "environment")
EVERY_NAMESPACE = "*"
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")  # spec_blocks.plugins.PluginName


@dataclass(frozen=True)
class PluginGrant:
    """Plug-ins (``kind:name``) granted to some namespaces (None: to every namespace)."""

    namespaces: frozenset[str] | None
    plugins: frozenset[str]

    @classmethod
    def parse(cls, entry: str) -> PluginGrant:
        """One ``--allow-plugins`` value; a ``UsageError`` saying what is wrong."""
        where, sep, what = entry.partition("=")
        if not sep:
            raise UsageError(f"--allow-plugins {entry[:200]!r}: use NAMESPACES=KIND:NAME,...")
        namespaces = None if where.strip() == EVERY_NAMESPACE else _namespaces(where)
        return cls(namespaces, frozenset(_plugin(p) for p in _items(what)))

    def covers(self, namespace: str) -> bool:
        return self.namespaces is None or namespace in self.namespaces

    def to_json(self) -> dict[str, list[str]]:
        """As the pool's spec spells a grant (its status repeats it)."""
        out = {kind + "s": sorted(_names_of(self.plugins, kind)) for kind in KINDS}
        if self.namespaces is not None:
            out = {"namespaces": sorted(self.namespaces), **out}
        return out


@dataclass(frozen=True)
class PluginAccess:
    """The allowlist; ``grants`` None: every namespace may name every plug-in."""

    grants: tuple[PluginGrant, ...] | None = None

    @classmethod
    def from_flags(cls, entries: Iterable[str]) -> PluginAccess:
        grants = tuple(PluginGrant.parse(e) for e in entries)
        return cls(grants if grants else None)

    def allows(self, namespace: str, kind: str, name: str) -> bool:
        if self.grants is None:
            return True
        key = f"{kind}:{name}"
        return any(key in g.plugins for g in self.grants if g.covers(namespace))

    def allowed(self, namespace: str, kind: str, installed: Iterable[str]) -> tuple[str, ...]:
        """Those of ``installed`` (names of one kind) that ``namespace`` may name."""
        return tuple(n for n in installed if self.allows(namespace, kind, n))

    def listing(self, installed: Installed) -> dict[str, Any]:
        """/v1/capacity's ``plugins``: what is installed, and under ``allowed`` the grants
        (None: no allowlist)."""
        grants = None if self.grants is None else [g.to_json() for g in self.grants]
        return {**installed.to_json(), "allowed": grants}


def _items(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _namespaces(text: str) -> frozenset[str]:
    found = _items(text)
    bad = [n for n in found if not _NAMESPACE.match(n)]
    if bad or not found:
        shown = repr(bad[0][:80]) if bad else "none"
        raise UsageError(f"--allow-plugins: namespace {shown} is not a namespace name (or '*')")
    return frozenset(found)


def _plugin(item: str) -> str:
    kind, _, name = item.partition(":")
    if kind not in KINDS or not _NAME.match(name):
        raise UsageError(
            f"--allow-plugins: {item[:200]!r} is not KIND:NAME (kind reward or environment)"
        )
    return f"{kind}:{name}"


def _names_of(plugins: Iterable[str], kind: str) -> list[str]:
    return [p.split(":", 1)[1] for p in plugins if p.split(":", 1)[0] == kind]


__all__ = ["KINDS", "PluginAccess", "PluginGrant"]
