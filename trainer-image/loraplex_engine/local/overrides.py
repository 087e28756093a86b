"""`run --only NAME` and `run --set [NAME:]path=value`: the manifest file as this run
trains it, edited before it is validated (so an edit is checked like the file itself).

``--only`` keeps the documents of those names (repeatable). ``--set`` changes one field
of every kept document's ``spec`` (``algorithm.maxSteps=4``; a leading ``spec.`` is
allowed), or of one document's (``say-yes:algorithm.maxSteps=4``); the value is read as
YAML (``4`` an integer, ``true`` a boolean, ``[q_proj, v_proj]`` a list). A field the
spec does not have, or a value it refuses, is a usage error naming the ``--set``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from loraplex_engine.local.manifests import parse_manifests, read_manifest_file
from loraplex_engine.spec.errors import UsageError
from loraplex_engine.spec.experiment import all_spec_errors


@dataclass(frozen=True)
class Override:
    """One ``--set``: the field's path under ``spec``, its value, and the document it is
    for (None: every one)."""

    raw: str
    path: tuple[str, ...]
    value: Any
    name: str | None = None

    @classmethod
    def parse(cls, raw: str) -> Override:
        target, sep, text = raw.partition("=")
        name, colon, path = target.rpartition(":")
        path = path.strip()
        path = path.removeprefix("spec.")
        keys = tuple(path.split("."))
        if not sep or not path or not all(keys):
            raise UsageError(f"--set {raw!r}: give [NAME:]path=value, e.g. algorithm.maxSteps=4")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            raise UsageError(f"--set {raw!r}: the value is not YAML") from None
        return cls(raw, keys, value, name.strip() if colon else None)

    def apply(self, spec: dict[str, Any]) -> None:
        node = spec
        for i, key in enumerate(self.path[:-1]):
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                where = ".".join(("spec", *self.path[: i + 1]))
                raise UsageError(f"--set {self.raw}: {where} is not a mapping")
            node = child
        node[self.path[-1]] = self.value

    def check(self, spec: dict[str, Any]) -> None:
        """The spec's own errors at or under this field: the --set's mistake."""
        field = ".".join(("spec", *self.path))
        for error in all_spec_errors(spec):
            if error.field == field or error.field.startswith(field + "."):
                raise UsageError(f"--set {self.raw}: {error.field}: {error.message}")


def manifest_text(source: str, only: tuple[str, ...] = (), sets: tuple[str, ...] = ()) -> str:
    """The manifest file's text with ``--only`` and ``--set`` applied (the file itself
    when neither is given: its own line numbers stay in YAML errors)."""
    text = read_manifest_file(source)
    if not only and not sets:
        return text
    parse_manifests(text, source)  # the file's own mistakes first, as without the flags
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    names = [d["metadata"]["name"] for d in docs]
    for name in only:
        if name not in names:
            raise UsageError(f"--only {name}: {source} has no such document (has {names})")
    if only:
        docs = [d for d in docs if d["metadata"]["name"] in only]
    overrides = [Override.parse(raw) for raw in sets]
    kept = {d["metadata"]["name"] for d in docs}
    for o in overrides:
        if o.name is not None and o.name not in kept:
            has = sorted(kept)
            raise UsageError(f"--set {o.raw}: no document {o.name!r} in this run (has {has})")
    for doc in docs:
        mine = [o for o in overrides if o.name in (None, doc["metadata"]["name"])]
        for o in mine:
            o.apply(doc["spec"])
        for o in mine:
            o.check(doc["spec"])
    return yaml.safe_dump_all(docs, sort_keys=False)
