"""Where ``task.dataset`` may be read from, decided in the engine before anything is
opened: a path beneath the namespace's directory of a data root, or an object-storage URL
under the namespace's prefix (tenancy/trust.py, tenancy/object_store.py). The result is
what the reader needs, and nothing of the tenant's beyond the checked location."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraplex_engine.spec.data_options import DatasetColumns, DatasetOptions, dataset_format
from loraplex_engine.spec.errors import TaskError
from loraplex_engine.tenancy.object_store import ObjectStore, ObjectUrl, is_object_url
from loraplex_engine.tenancy.trust import TrustPolicy


@dataclass(frozen=True)
class LocalSource:
    path: Path  # resolved, inside base
    base: Path  # the namespace's directory of a data root
    allow_hard_links: bool


@dataclass(frozen=True)
class ObjectSource:
    url: ObjectUrl
    store: ObjectStore


@dataclass(frozen=True)
class DatasetSource:
    """A checked dataset: where, in which format, which columns; ``shown`` is the
    tenant's own spelling, for messages."""

    where: LocalSource | ObjectSource
    format: str
    split: str | None
    columns: tuple[str, str]
    shown: str


def resolve_dataset(
    trust: TrustPolicy, dataset: str, options: DatasetOptions | None, namespace: str
) -> DatasetSource:
    """The source ``namespace`` may read; TaskError (spec.task.dataset) if none."""
    where: LocalSource | ObjectSource
    if is_object_url(dataset):
        where = ObjectSource(trust.objects.check(dataset, namespace), trust.objects)
    else:
        path, base = trust.data.resolve(dataset, namespace)
        where = LocalSource(path, base, trust.data.allow_hard_links)
    columns = options.columns if options is not None else DatasetColumns()
    fmt = dataset_format(dataset, options)
    split = options.split if options is not None else None
    if split is not None and fmt != "hf-disk":
        raise TaskError(
            "spec.task.datasetOptions.split", f"only hf-disk datasets have splits, not {fmt}"
        )
    return DatasetSource(where, fmt, split, (columns.prompt, columns.answer), dataset)
