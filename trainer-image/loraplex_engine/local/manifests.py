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

from loraplex_engine.plan.experiment import check_task as plan_check_task
from loraplex_engine.plan.experiment import plan_problems
from loraplex_engine.plan.limits import EngineLimits
from loraplex_engine.spec.errors import InvalidSpecError, ManifestError, SpecError, UsageError
from loraplex_engine.spec.experiment import ExperimentSpec, all_spec_errors, parse_spec

API_VERSION = "loraplex.dev/v1alpha1"
KIND = "LoRAExperiment"
# Kubernetes object names (DNS-1123 label); namespaces hold no dot, so
# "<namespace>.<name>" is a valid, unambiguous experiment id.
NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_RANK = 256  # the schema's own bound on spec.lora.rank: no engine flag given


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


def _check_doc(
    doc: Any, max_rank: int | None, known_modules: Iterable[str] | None
) -> Manifest | list[SpecError]:
    """One document -> Manifest, or every problem found in it (each naming its field)."""
    if not isinstance(doc, dict):
        return [SpecError("(document)", "must be a mapping")]
    problems = []
    if doc.get("apiVersion") != API_VERSION:
        problems.append(
            SpecError("apiVersion", f"must be {API_VERSION}, got {doc.get('apiVersion')!r}")
        )
    if doc.get("kind") != KIND:
        problems.append(SpecError("kind", f"must be {KIND}, got {doc.get('kind')!r}"))
    meta = doc.get("metadata")
    if not isinstance(meta, dict):
        problems.append(SpecError("metadata", "required (with metadata.name)"))
        meta = {}
    name, namespace = meta.get("name"), meta.get("namespace", "default")
    for field, value in (("metadata.name", name), ("metadata.namespace", namespace)):
        if not isinstance(value, str) or not NAME_RE.match(value) or len(value) > 63:
            problems.append(SpecError(field, f"must be a DNS-1123 label, got {value!r}"))
    if "spec" not in doc:
        return [*problems, SpecError("spec", "required")]
    spec_problems = all_spec_errors(doc["spec"])  # every field at once, not the first
    if spec_problems:
        return problems + spec_problems
    spec = parse_spec(doc["spec"])
    if spec.client is not None:
        why = "the local runner trains task experiments; a client's model trains on a cluster"
        return [*problems, SpecError("spec.client", why + " (through the gateway)")]
    problems += engine_problems(spec, max_rank, known_modules)
    return problems or Manifest(name, namespace, spec)


def engine_problems(
    spec: ExperimentSpec, max_rank: int | None, known_modules: Iterable[str] | None
) -> list[SpecError]:
    """What the engine's plan (plan/experiment.py) would refuse, before the model loads:
    its rank, its task's params, and its target modules where the model's are known."""
    known = frozenset(known_modules) if known_modules is not None else None
    limits = EngineLimits(max_rank if max_rank is not None else MAX_RANK, known)
    return [SpecError(e.field or "spec", e.message) for e in plan_problems(spec, limits)]


def parse_manifests(
    text: str,
    source: str = "<manifests>",
    max_rank: int | None = None,
    known_modules: Iterable[str] | None = None,
) -> list[Manifest]:
    """All experiments in a multi-document YAML string, or ``ManifestError`` listing every
    problem of every document. ``known_modules`` None: target modules are not checked."""
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
        checked = _check_doc(doc, max_rank, known)
        if isinstance(checked, list):
            problems += [f"{_label(index, doc)}: {e.field}: {e.message}" for e in checked]
            continue
        if checked.id in seen:
            problems.append(f"{_label(index, doc)}: metadata.name: duplicate {checked.id!r}")
            continue
        seen.add(checked.id)
        out.append(checked)
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


def validate_for_engine(spec: ExperimentSpec, max_rank: int, known_modules: Iterable[str]) -> None:
    """Checks that depend on the engine (pool limits, base model); raise ``SpecError``."""
    problems = engine_problems(spec, max_rank, known_modules)
    if problems:
        raise problems[0]


def check_task(spec: ExperimentSpec) -> None:
    """Task parameters (free-form in the schema) against the task's known ones."""
    try:
        plan_check_task(spec)
    except InvalidSpecError as exc:
        raise SpecError(exc.field or "spec.task", exc.message) from None
