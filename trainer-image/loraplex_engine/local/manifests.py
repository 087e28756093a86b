"""Load ``LoRAExperiment`` manifests from a YAML file (the local runner's input).

The same documents ``kubectl apply`` would take; every problem is found up
front and reported together, each naming its document and field.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from loraplex_engine.errors import ManifestError, SpecError, UsageError
from loraplex_engine.spec import ExperimentSpec, parse_spec

API_VERSION = "loraplex.dev/v1alpha1"
KIND = "LoRAExperiment"
# Kubernetes object names (DNS-1123 label); namespaces hold no dot, so
# "<namespace>.<name>" is a valid, unambiguous experiment id.
NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class Manifest(NamedTuple):
    name: str
    namespace: str
    spec: ExperimentSpec

    @property
    def id(self) -> str:
        return f"{self.namespace}.{self.name}"


def _label(index: int, doc: Any) -> str:
    meta = doc.get("metadata") if isinstance(doc, dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    return f"document {index}" + (f" ({name!r})" if name else "")


def _check_doc(doc: Any, max_rank: int | None, known_modules: Iterable[str] | None) -> Manifest:
    """One document → Manifest; raises SpecError naming the field."""
    if not isinstance(doc, dict):
        raise SpecError("(document)", "must be a mapping")
    if doc.get("apiVersion") != API_VERSION:
        raise SpecError("apiVersion", f"must be {API_VERSION}, got {doc.get('apiVersion')!r}")
    if doc.get("kind") != KIND:
        raise SpecError("kind", f"must be {KIND}, got {doc.get('kind')!r}")
    meta = doc.get("metadata")
    if not isinstance(meta, dict):
        raise SpecError("metadata", "required (with metadata.name)")
    name, namespace = meta.get("name"), meta.get("namespace", "default")
    for field, value in (("metadata.name", name), ("metadata.namespace", namespace)):
        if not isinstance(value, str) or not NAME_RE.match(value) or len(value) > 63:
            raise SpecError(field, f"must be a DNS-1123 label, got {value!r}")
    if "spec" not in doc:
        raise SpecError("spec", "required")
    spec = parse_spec(doc["spec"])
    spec.check_task()
    if max_rank is not None or known_modules is not None:
        spec.validate_for_engine(
            max_rank if max_rank is not None else 256,
            known_modules if known_modules is not None else spec.lora.target_modules or (),
        )
    return Manifest(name, namespace, spec)


def parse_manifests(
    text: str,
    source: str = "<manifests>",
    max_rank: int | None = None,
    known_modules: Iterable[str] | None = None,
) -> list[Manifest]:
    """All experiments in a multi-document YAML string, or ``ManifestError``."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ManifestError(source, [f"invalid YAML: {_yaml_problem(exc)}"]) from None
    if not docs:
        raise ManifestError(source, ["no documents"])
    known = list(known_modules) if known_modules is not None else None
    out: list[Manifest] = []
    problems: list[str] = []
    seen: set[str] = set()
    for index, doc in enumerate(docs):
        try:
            manifest = _check_doc(doc, max_rank, known)
        except SpecError as exc:
            problems.append(f"{_label(index, doc)}: {exc.field}: {exc.message}")
            continue
        if manifest.id in seen:
            problems.append(f"{_label(index, doc)}: metadata.name: duplicate {manifest.id!r}")
            continue
        seen.add(manifest.id)
        out.append(manifest)
    if problems:
        raise ManifestError(source, problems)
    return out


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: what PyYAML found and where (its own message spans several lines)."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem is None:
        return " ".join(str(exc).split())
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + problem


def read_manifest_file(path: str | Path) -> str:
    """The file's text, or ``UsageError`` naming the file."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"manifest file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"manifest file {path}: not UTF-8 text") from None


def load_manifests(
    path: str | Path, max_rank: int | None = None, known_modules: Iterable[str] | None = None
) -> list[Manifest]:
    return parse_manifests(read_manifest_file(path), str(path), max_rank, known_modules)
