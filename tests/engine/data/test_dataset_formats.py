"""The dataset task on local files (data/: sources, the reader process, the spool): Parquet
and directories written by the real ``datasets`` library read with the columns the spec
maps, and every hostile dataset refused with a TaskError naming what is wrong, through
the same reader process the engine runs. The S3 path and a real engine process are
test_datasets_live.py."""

from __future__ import annotations

import json
import os
import random
import struct
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
from loraplex_engine.data.sources import resolve_dataset
from loraplex_engine.spec.data_options import DatasetOptions
from loraplex_engine.spec.errors import TaskError
from loraplex_engine.tasks import build_task
from loraplex_engine.tasks.base import Task
from loraplex_engine.tasks.dataset import DatasetTask, open_dataset
from loraplex_engine.tasks.jsonl import JsonlTask
from loraplex_engine.tenancy.trust import DataRoots, TrustPolicy

NS = "team-a"


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    for ns in (NS, "team-b"):
        (tmp_path / ns).mkdir()
    return tmp_path


def _open(root: Path, dataset: str, options: dict[str, Any] | None = None, **kw: Any) -> Task:
    trust = TrustPolicy(data=DataRoots((root,), allow_hard_links=kw.pop("hard_links", False)))
    opts = DatasetOptions.model_validate(options) if options is not None else None
    source = resolve_dataset(trust, dataset, opts, NS)
    if kw:
        return DatasetTask(source, {}, None, **kw)
    return open_dataset(source, {}, None)


def _refusal(root: Path, dataset: str, options: dict[str, Any] | None = None, **kw: Any) -> str:
    with pytest.raises(TaskError) as info:
        _open(root, dataset, options, **kw).close()
    assert info.value.field.startswith("spec.task.")
    return info.value.message


def _rows(task: Task) -> list[tuple[str, str]]:
    assert isinstance(task, DatasetTask | JsonlTask)
    return [(p.text, p.answer) for p in (task.row(i) for i in range(len(task)))]


def _parquet(path: Path, table: dict[str, list[Any]], **kw: Any) -> Path:
    pq.write_table(pa.table(table), path, **kw)
    return path


def test_a_parquet_file_is_read_with_the_columns_the_spec_maps(root: Path) -> None:
    questions = [f"question {i}" for i in range(1000)]
    _parquet(
        root / NS / "gsm.parquet",
        {"question": questions, "solution": [str(i) for i in range(1000)], "n": list(range(1000))},
        row_group_size=300,  # several row groups, several batches each
    )
    task = _open(root, "gsm.parquet", {"columns": {"prompt": "question", "answer": "solution"}})
    assert isinstance(task, DatasetTask)
    assert _rows(task) == [(q, str(i)) for i, q in enumerate(questions)]
    sampled = task.sample_prompts(8, random.Random(0))
    assert all(p.text == f"question {p.answer}" for p in sampled)
    assert task.score(sampled, [p.answer for p in sampled]) == [1.0] * 8  # exact match
    assert task.row(7).position == "row 7"  # what a too-long prompt's error names
    task.close()


def test_a_saved_dataset_directory_is_read_split_by_split(root: Path) -> None:
    train = datasets.Dataset.from_dict({"q": ["a", "b", "c"], "a": ["1", "2", "3"]})
    test = datasets.Dataset.from_dict({"q": ["x"], "a": ["9"]})
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(root / NS / "dd"))
    train.save_to_disk(str(root / NS / "single"), num_shards=2)  # two Arrow files
    columns = {"prompt": "q", "answer": "a"}
    assert _rows(_open(root, "dd", {"columns": columns})) == [("a", "1"), ("b", "2"), ("c", "3")]
    assert _rows(_open(root, "dd", {"columns": columns, "split": "test"})) == [("x", "9")]
    assert len(_open(root, "single", {"columns": columns})) == 3
    assert "no split 'dev'" in _refusal(root, "dd", {"columns": columns, "split": "dev"})
    assert "remove datasetOptions.split" in _refusal(
        root, "single", {"columns": columns, "split": "train"}
    )


def test_a_local_jsonl_file_with_other_keys_is_still_read_in_place(root: Path) -> None:
    (root / NS / "qa.jsonl").write_text(json.dumps({"q": "p", "a": "y"}) + "\n")
    task = _open(root, "qa.jsonl", {"columns": {"prompt": "q", "answer": "a"}})
    assert isinstance(task, JsonlTask)  # appended rows picked up, as before
    assert _rows(task) == [("p", "y")]
    with (root / NS / "qa.jsonl").open("a") as f:
        f.write(json.dumps({"q": "p2", "a": "y2"}) + "\n")
    task.refresh()
    assert _rows(task) == [("p", "y"), ("p2", "y2")]
    assert task.row(1).position == "line 2"
    assert 'row must be {"prompt": str, "answer": str}' in _refusal(root, "qa.jsonl")


def test_the_old_jsonl_task_and_string_dataset_still_work(root: Path) -> None:
    (root / NS / "x.jsonl").write_text(json.dumps({"prompt": "p", "answer": "a"}) + "\n")
    assert len(build_task("jsonl", dataset=str(root / NS / "x.jsonl"))) == 1  # type: ignore[arg-type]


def _bad_files(root: Path) -> dict[str, tuple[str, dict[str, Any] | None, str]]:
    """name -> (dataset, options, what the refusal says)."""
    d = root / NS
    _parquet(d / "nulls.parquet", {"prompt": ["a", None], "answer": ["1", "2"]})
    _parquet(d / "ints.parquet", {"prompt": ["a"], "answer": [1]})
    _parquet(d / "long.parquet", {"prompt": ["a", "x" * 70_000], "answer": ["1", "2"]})
    (d / "not.parquet").write_bytes(b"PAR1 but not really")
    bad_state = d / "escape"
    datasets.Dataset.from_dict({"prompt": ["a"], "answer": ["b"]}).save_to_disk(str(bad_state))
    state = json.loads((bad_state / "state.json").read_text())
    state["_data_files"] = [{"filename": "../../team-b/secret.arrow"}]
    (bad_state / "state.json").write_text(json.dumps(state))
    (d / "empty-dir").mkdir()
    return {
        "null": ("nulls.parquet", None, "row 1: column 'prompt' is null"),
        "type": ("ints.parquet", None, "column 'answer' is int64, not a string"),
        "missing": ("ints.parquet", {"columns": {"prompt": "question"}}, "no column 'question'"),
        "row size": ("long.parquet", None, "row 1: 70001 bytes of prompt and answer, over"),
        "not parquet": ("not.parquet", None, "not a Parquet file"),
        "state escape": ("escape", None, "not a plain name"),
        "no state": ("empty-dir", None, "does not exist"),
        "split on parquet": ("ints.parquet", {"split": "train"}, "only hf-disk datasets have"),
    }


def test_every_hostile_dataset_is_a_task_error_naming_what_is_wrong(root: Path) -> None:
    for name, (dataset, options, expected) in _bad_files(root).items():
        message = _refusal(root, dataset, options, max_row_bytes=65536)
        assert expected in message, (name, message)


def test_the_row_and_byte_limits_hold(root: Path) -> None:
    _parquet(root / NS / "big.parquet", {"prompt": ["p"] * 1000, "answer": ["a"] * 1000})
    assert "over this engine's limit of 999 rows" in _refusal(root, "big.parquet", max_rows=999)
    assert "limit of 1000 bytes" in _refusal(root, "big.parquet", max_bytes=1000)
    assert len(_open(root, "big.parquet", max_rows=1000, max_bytes=2000)) == 1000


def _repeated(path: Path, value_bytes: int, rows: int) -> Path:
    """A Parquet file of one value repeated: its dictionary page and a few KB of indices."""
    prompt = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), ["x" * value_bytes])
    table = pa.table({"prompt": prompt, "answer": ["a"] * rows})
    pq.write_table(table, path, compression="zstd", dictionary_pagesize_limit=1 << 30)
    assert path.stat().st_size < 1 << 20
    return path


def test_a_small_file_that_expands_to_gigabytes_is_refused(root: Path) -> None:
    """6 GB of strings from a file under 1 MiB: the byte bound stops it a batch in; 32 GB
    of 16 MB values is refused at its first row, inside a reader of 1 GiB."""
    _repeated(root / NS / "bomb.parquet", 60_000, 100_000)
    message = _refusal(root, "bomb.parquet", max_bytes=64 << 20, memory_bytes=1 << 30)
    assert "limit of 67108864 bytes" in message
    _repeated(root / NS / "huge.parquet", 16 << 20, 2048)
    message = _refusal(root, "huge.parquet", memory_bytes=1 << 30)
    assert "row 0: 16777217 bytes of prompt and answer, over the limit" in message


def test_a_lying_compressed_buffer_meets_the_readers_memory_bound(root: Path) -> None:
    """An Arrow file (a saved dataset's) whose zstd buffer claims 3 GiB once decompressed:
    the reader's allocation fails under its address-space limit, and that is the dataset's
    error, not the engine's."""
    d, n = root / NS / "bomb", 123_457
    d.mkdir()
    table = pa.table({"prompt": ["x" * n], "answer": ["a"]})
    zstd = ipc.IpcWriteOptions(compression="zstd")
    with ipc.new_stream(d / "data.arrow", table.schema, options=zstd) as w:
        w.write_table(table)
    raw = (d / "data.arrow").read_bytes()
    assert struct.pack("<q", n) in raw  # the buffer's uncompressed length
    (d / "data.arrow").write_bytes(raw.replace(struct.pack("<q", n), struct.pack("<q", 3 << 30)))
    (d / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data.arrow"}]}))
    assert "needs more than the reader's 1024 MiB" in _refusal(root, "bomb", memory_bytes=1 << 30)


def test_links_inside_a_saved_directory_are_not_followed(root: Path) -> None:
    theirs = root / "team-b" / "secret"
    datasets.Dataset.from_dict({"prompt": ["B-SECRET"], "answer": ["b"]}).save_to_disk(str(theirs))
    ours = root / NS / "ds"
    datasets.Dataset.from_dict({"prompt": ["a"], "answer": ["b"]}).save_to_disk(str(ours))
    arrow = next(ours.glob("*.arrow"))
    arrow.unlink()
    arrow.symlink_to(next(theirs.glob("*.arrow")))
    assert "a symbolic link" in _refusal(root, "ds")
    arrow.unlink()
    os.link(next(theirs.glob("*.arrow")), arrow)  # a hard link: another tenant's file
    assert "hard links" in _refusal(root, "ds")
    assert _rows(_open(root, "ds", hard_links=True)) == [("B-SECRET", "b")]  # when allowed
