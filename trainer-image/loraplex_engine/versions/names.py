"""Model names that address a published version (pure): ``<namespace>.<name>@v<N>`` (one
version) and ``<namespace>.<name>:<alias>`` (where the alias points when the request
arrives). The namespace is a DNS label (no dots), so the first dot splits it off; the
name is a Kubernetes object name. Anything else is no version name (None)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_NS = r"(?P<ns>[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)"
_NAME = r"(?P<name>[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?)"
_WHICH = r"(@v(?P<v>[1-9][0-9]{0,8})|:(?P<alias>[a-z]([-a-z0-9]{0,30}[a-z0-9])?))"
_REF = re.compile(_NS + r"\." + _NAME + _WHICH)


TINKER_SCHEME = "tinker://"


@dataclass(frozen=True)
class VersionName:
    namespace: str
    name: str
    version: int | None  # @v<N>
    alias: str | None  # :<alias>

    @property
    def experiment(self) -> str:
        return f"{self.namespace}.{self.name}"


def parse(model: str) -> VersionName | None:
    m = _REF.fullmatch(model)
    if m is None:
        return None
    v = m.group("v")
    return VersionName(m.group("ns"), m.group("name"), int(v) if v else None, m.group("alias"))


def untinkered(path: str) -> str:
    """A version name as a Tinker sampler takes it, ``tinker://<ns>.<name>@v<N>`` (the
    SDK sends only ``tinker://`` paths), without the scheme; other names unchanged."""
    rest = path.removeprefix(TINKER_SCHEME)
    return rest if parse(rest) is not None else path


def served_name(namespace: str, name: str, version: int) -> str:
    """The adapter name a served version has (in a vLLM fleet; an engine's slot adds its
    content hash, versions/slot_cache.py): the version's own, so an alias flip never
    reuses a name for other weights."""
    return f"{namespace}.{name}@v{version}"
