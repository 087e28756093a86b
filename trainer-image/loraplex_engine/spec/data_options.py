"""``task.datasetOptions``: how the rows of ``task.dataset`` are read (its format, split
and which columns are the prompt and the answer). Part of the experiment spec (spec/experiment.py);
free of I/O. docs/datasets.md tells the tenant's side."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from loraplex_engine.spec.schema import SpecModel

DatasetFormat = Literal["jsonl", "parquet", "hf-disk"]
# A column (or JSON key) name: printable, no control characters.
ColumnName = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]
SplitName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][\w.-]*$")]
SUFFIXES: dict[str, DatasetFormat] = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}


class DatasetColumns(SpecModel):
    """Which column of each row is what."""

    prompt: ColumnName = Field("prompt", description="The column (JSONL: key) of the prompt.")
    answer: ColumnName = Field(
        "answer", description="The column (JSONL: key) of the answer the reward compares with."
    )


class DatasetOptions(SpecModel):
    """How ``task.dataset`` is read."""

    format: DatasetFormat | None = Field(
        None,
        description="jsonl (one JSON object a line), parquet (one file), or hf-disk (a "
        "directory written by the datasets library's save_to_disk). Absent = from the "
        "name: .jsonl and .ndjson are jsonl, .parquet is parquet, anything else hf-disk.",
    )
    split: SplitName | None = Field(
        None,
        description="hf-disk only: the split of a saved DatasetDict to read. Absent = train, "
        "or the only split there is.",
    )
    columns: DatasetColumns = Field(
        default_factory=DatasetColumns,  # type: ignore[arg-type]
        description="The columns that hold each row's prompt and answer (both strings).",
    )


def dataset_format(dataset: str, options: DatasetOptions | None) -> DatasetFormat:
    """The format ``options`` names, else the one ``dataset``'s name implies."""
    if options is not None and options.format is not None:
        return options.format
    name = dataset.rstrip("/").rsplit("/", 1)[-1].lower()
    for suffix, fmt in SUFFIXES.items():
        if name.endswith(suffix):
            return fmt
    return "hf-disk"
