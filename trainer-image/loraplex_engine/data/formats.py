"""A dataset's rows read batch by batch from JSONL, Parquet or a directory saved by the
datasets library, whatever opens its files (data/openers.py), as columnar batches: each
row's prompt and answer lengths and their UTF-8 bytes back to back.

Run only in the reader process (data/child.py): the bytes are the tenant's, so every
column is checked (present, a string, no nulls, valid UTF-8) and every row is measured
against ``max_row_bytes``. What stays in memory is one batch (1,024 rows); Arrow
batches are never turned into Python strings (a million rows take seconds, not minutes,
at the reader's idle priority).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import BinaryIO, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from loraplex_engine.data.jsonl_rows import BLANK, parse_row
from loraplex_engine.spec.errors import DataFileMissing as Missing
from loraplex_engine.spec.errors import DataReadError as DataError

Row = tuple[str, str]
Column = tuple[np.ndarray, bytes | memoryview]  # each row's byte length; the bytes
Batch = tuple[Column, Column]  # the prompts', the answers'
BATCH_ROWS = 1024  # rows decoded at a time: at most 256 MiB at the row bound
CHUNK_BYTES = 1 << 20  # JSONL bytes read at a time
READ_BUFFER = 1 << 20  # Parquet column data buffered at a time (not a whole row group)
MAX_JSON_BYTES = 1 << 20  # a saved dataset's state.json or dataset_dict.json
MAX_FILES = 10_000  # data files of one saved split
# A saved dataset's file or split name: one path component, nothing that walks.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")


class Opener(Protocol):
    shown: str  # the dataset as the tenant wrote it

    def open(self, *names: str) -> BinaryIO:
        """The dataset file (no names) or one of the files of its directory; Missing if
        it is not there, DataError if it may not or cannot be opened."""
        ...


def read_batches(
    opener: Opener, fmt: str, split: str | None, columns: Row, max_row_bytes: int
) -> Iterator[Batch]:
    if fmt == "jsonl":
        with opener.open() as f:
            yield from jsonl_rows(f, opener.shown, columns, max_row_bytes)
    elif fmt == "parquet":
        with opener.open() as f:
            yield from parquet_rows(f, opener.shown, columns, max_row_bytes)
    elif fmt == "hf-disk":
        yield from saved_rows(opener, split, columns, max_row_bytes)
    else:
        raise DataError(f"unknown format {fmt!r}")


def jsonl_rows(f: BinaryIO, shown: str, columns: Row, max_line: int) -> Iterator[Batch]:
    """Line by line, as tasks/jsonl.py checks a local file; a line over ``max_line`` is
    refused before it is joined, let alone decoded."""
    line_no, carry, rows = 0, b"", []
    while chunk := f.read(CHUNK_BYTES):
        lines = (carry + chunk).split(b"\n")
        carry = lines.pop()
        for raw in lines:
            line_no += 1
            rows.extend(_jsonl_row(raw, f"{shown}:{line_no}", columns, max_line))
        if len(carry) > max_line:
            raise DataError(f"{shown}:{line_no + 1}: line is over the limit of {max_line} bytes")
        if len(rows) >= BATCH_ROWS:
            yield text_batch(rows)
            rows = []
    rows.extend(_jsonl_row(carry, f"{shown}:{line_no + 1}", columns, max_line))
    if rows:
        yield text_batch(rows)


def _jsonl_row(raw: bytes, where: str, columns: Row, max_line: int) -> list[Row]:
    if len(raw) > max_line:
        raise DataError(f"{where}: line of {len(raw)} bytes is over the limit of {max_line}")
    if not raw.strip(BLANK):
        return []
    parsed = parse_row(raw, columns)
    if isinstance(parsed, str):
        raise DataError(f"{where}: {parsed}")
    return [(parsed[0], parsed[1])]


def text_batch(rows: list[Row]) -> Batch:
    def column(values: list[bytes]) -> Column:
        return np.fromiter(map(len, values), np.int64, len(values)), b"".join(values)

    return (
        column([p.encode("utf-8") for p, _ in rows]),
        column([a.encode("utf-8") for _, a in rows]),
    )


def parquet_rows(f: BinaryIO, shown: str, columns: Row, max_row_bytes: int) -> Iterator[Batch]:
    """Batch by batch, as plain strings: reading as dictionaries would measure a value
    repeated a million times without expanding it, but building the dictionary of a
    million distinct values took 50 times the CPU. A batch of a repeated huge value is
    expanded, then, and meets the reader's address-space limit (data/child.py) or the
    row bound, either one a TaskError of that dataset."""
    wanted = list(dict.fromkeys(columns))
    try:
        footer = pq.ParquetFile(f)
        _check_schema(footer.schema_arrow, shown, columns)
        pf = pq.ParquetFile(f, metadata=footer.metadata, buffer_size=READ_BUFFER, pre_buffer=False)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"{shown}: not a Parquet file ({_short(e)})") from None
    row = 0
    for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=wanted, use_threads=False):
        yield arrow_batch(batch, shown, columns, row, max_row_bytes, trusted=True)
        row += batch.num_rows


def arrow_stream_rows(
    f: BinaryIO, shown: str, columns: Row, first_row: int, max_row_bytes: int
) -> Iterator[Row]:
    """An Arrow IPC stream (the files ``save_to_disk`` writes), batch by batch."""
    try:
        reader = ipc.open_stream(f)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"{shown}: not an Arrow stream ({_short(e)})") from None
    _check_schema(reader.schema, shown, columns)
    row = first_row
    for batch in reader:
        for start in range(0, batch.num_rows, BATCH_ROWS):
            part = batch.slice(start, BATCH_ROWS)
            yield arrow_batch(part, shown, columns, row, max_row_bytes)
            row += part.num_rows


def saved_rows(
    opener: Opener, split: str | None, columns: Row, max_row_bytes: int
) -> Iterator[Batch]:
    """A directory written by ``Dataset.save_to_disk`` (``state.json`` naming its Arrow
    files) or ``DatasetDict.save_to_disk`` (``dataset_dict.json`` naming the splits, one
    such directory each)."""
    shown = opener.shown
    where: tuple[str, ...] = ()
    try:
        splits = _json(opener, "dataset_dict.json").get("splits")
    except Missing:
        splits = None
        if split is not None:
            raise DataError(
                f"{shown} is a single split (no dataset_dict.json): remove datasetOptions.split"
            ) from None
    if splits is not None:
        where = (_split_of(splits, split, shown),)
    state = _json(opener, *where, "state.json")
    files = state.get("_data_files")
    if not isinstance(files, list) or not 0 < len(files) <= MAX_FILES:
        raise DataError(f"{shown}: state.json's _data_files is not a list of 1-{MAX_FILES} files")
    row = 0
    for entry in files:
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not _NAME.match(name):
            raise DataError(f"{shown}: state.json names a data file that is not a plain name")
        with opener.open(*where, name) as f:
            for batch in arrow_stream_rows(
                f, f"{shown}/{'/'.join((*where, name))}", columns, row, max_row_bytes
            ):
                row += len(batch[0][0])
                yield batch


def _split_of(splits: object, split: str | None, shown: str) -> str:
    if not isinstance(splits, list) or not all(
        isinstance(s, str) and _NAME.match(s) for s in splits
    ):
        raise DataError(f"{shown}: dataset_dict.json's splits are not a list of plain names")
    if split is None:
        split = "train" if "train" in splits or len(splits) != 1 else splits[0]
    if split not in splits:
        raise DataError(f"{shown}: no split {split!r} (it has {', '.join(splits[:20])})")
    return split


def _json(opener: Opener, *names: str) -> dict:
    with opener.open(*names) as f:
        raw = f.read(MAX_JSON_BYTES + 1)
    where = f"{opener.shown}/{'/'.join(names)}"
    if len(raw) > MAX_JSON_BYTES:
        raise DataError(f"{where}: over {MAX_JSON_BYTES} bytes")
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeError, ValueError, RecursionError):
        raise DataError(f"{where}: not valid JSON") from None
    if not isinstance(value, dict):
        raise DataError(f"{where}: not a JSON object")
    return value


def _check_schema(schema: pa.Schema, shown: str, columns: Row) -> None:
    for column in dict.fromkeys(columns):
        if schema.get_field_index(column) < 0:
            names = ", ".join(schema.names[:20])
            raise DataError(f"{shown}: no column {column!r} (it has: {names})")
        kind = schema.field(column).type
        value = kind.value_type if pa.types.is_dictionary(kind) else kind
        if not (
            pa.types.is_string(value)
            or pa.types.is_large_string(value)
            or pa.types.is_string_view(value)
        ):
            raise DataError(f"{shown}: column {column!r} is {kind}, not a string")


def arrow_batch(
    batch: pa.RecordBatch,
    shown: str,
    columns: Row,
    first_row: int,
    max_row_bytes: int,
    trusted: bool = False,
) -> Batch:
    """The batch's two columns, once they are valid and each row is within the bound.
    ``trusted``: its offsets are Arrow's own (decoded from Parquet pages, not read from the
    file), so only the UTF-8 of what is kept is checked, not a whole shared dictionary's
    once a batch."""
    if not trusted:
        _validate(batch, shown, first_row)  # offsets inside their buffers, UTF-8
    arrays = [batch.column(c) for c in columns]
    total = np.zeros(batch.num_rows, dtype=np.int64)
    for column, array in zip(columns, arrays, strict=True):
        if array.null_count:
            at = int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataError(f"{shown}: row {first_row + at}: column {column!r} is null")
        total += _lengths(array)
    over = np.flatnonzero(total > max_row_bytes)
    if over.size:
        at = int(over[0])
        raise DataError(
            f"{shown}: row {first_row + at}: {int(total[at])} bytes of prompt and answer, "
            f"over the limit of {max_row_bytes}"
        )
    decoded = [_plain(a) for a in arrays]
    if trusted:
        for array in decoded:
            _validate(array, shown, first_row)
    return _column(decoded[0]), _column(decoded[1])


def _validate(data: pa.RecordBatch | pa.Array, shown: str, first_row: int) -> None:
    try:
        data.validate(full=True)
    except pa.ArrowException as e:
        raise DataError(f"{shown}: rows {first_row}+: invalid data ({_short(e)})") from None


def _plain(array: pa.Array) -> pa.Array:
    """A string or large string array: expanded from its dictionary (once every row is
    known to be within the bound), a string view cast."""
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    if not (pa.types.is_string(array.type) or pa.types.is_large_string(array.type)):
        array = array.cast(pa.large_string())
    return array


def _column(array: pa.Array) -> Column:
    """A plain string column's lengths and bytes, without a Python object per value."""
    if len(array) == 0:
        return np.zeros(0, dtype=np.int64), b""
    wide = np.int64 if pa.types.is_large_string(array.type) else np.int32
    _, offsets_buf, data_buf = array.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=wide)[array.offset : array.offset + len(array) + 1]
    start, end = int(offsets[0]), int(offsets[-1])
    data = memoryview(data_buf)[start:end] if data_buf is not None else b""
    return np.diff(offsets).astype(np.int64), data


def _lengths(array: pa.Array) -> np.ndarray:
    """Each value's UTF-8 bytes, without materialising a dictionary-encoded column."""
    if pa.types.is_dictionary(array.type):
        sizes = pc.binary_length(array.dictionary)
        return pc.take(sizes, array.indices).to_numpy(zero_copy_only=False).astype(np.int64)
    return pc.binary_length(array).to_numpy(zero_copy_only=False).astype(np.int64)


def _short(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text[:200]
