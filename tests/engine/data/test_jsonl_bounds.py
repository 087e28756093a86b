"""tasks/jsonl.py and tenancy/data_files.py (issue 26, items 1 and 2): a dataset is opened
beneath its directory without following links and read through that descriptor; its rows
are an index of offsets; every bound (line bytes, rows, bytes per refresh) holds, and every
parse failure is a TaskError naming the line. The attacks on a real engine process are
test_data_attacks.py."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest
from loraplex_engine.spec.errors import TaskError
from loraplex_engine.tasks import jsonl
from loraplex_engine.tasks.jsonl import JsonlTask

from tests.support.jsonl_rows import jsonl_row


def _refusal(path: Path, **kw: object) -> str:
    with pytest.raises(TaskError) as info:
        JsonlTask(path, **kw)  # type: ignore[arg-type]
    assert info.value.field == "spec.task.dataset"
    return info.value.message


@pytest.fixture()
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    own, other = tmp_path / "team-a", tmp_path / "team-b"
    own.mkdir()
    other.mkdir()
    (other / "private.jsonl").write_text(jsonl_row("B-SECRET"))
    return own, other


def test_a_directory_on_the_way_swapped_for_a_symlink_is_refused(dirs) -> None:
    own, other = dirs
    (own / "sub").mkdir()
    (own / "sub" / "private.jsonl").write_text(jsonl_row("mine"))
    task = JsonlTask(own / "sub" / "private.jsonl", root=own)
    (own / "sub").rename(own / "old")
    (own / "sub").symlink_to(other)  # same file name, now through a link to team-b
    with pytest.raises(TaskError, match="not allowed: a symbolic link"):
        task.sample_prompts(1, random.Random(0))
    task.close()


def test_a_file_replaced_by_rename_is_read_again_through_the_same_walk(dirs) -> None:
    own, _ = dirs
    path = own / "d.jsonl"
    path.write_text(jsonl_row("old"))
    task = JsonlTask(path, root=own)
    fresh = own / "fresh.jsonl"
    fresh.write_text(jsonl_row("new 1") + jsonl_row("new 2"))
    fresh.rename(path)  # a new inode under the same name
    assert {p.text for p in task.sample_prompts(8, random.Random(0))} == {"new 1", "new 2"}
    assert len(task) == 2
    task.close()


def test_hard_links_are_refused_unless_allowed(dirs) -> None:
    own, other = dirs
    os.link(other / "private.jsonl", own / "linked.jsonl")
    message = _refusal(own / "linked.jsonl", root=own)
    assert "2 hard links" in message and "unless the pool allows it" in message
    task = JsonlTask(own / "linked.jsonl", root=own, allow_hard_links=True)
    assert len(task) == 1
    task.close()


def test_a_fifo_is_refused_without_blocking(dirs) -> None:
    own, _ = dirs
    os.mkfifo(own / "pipe.jsonl")
    result: list[str] = []
    t = threading.Thread(target=lambda: result.append(_refusal(own / "pipe.jsonl", root=own)))
    t.start()
    t.join(10)
    assert result and "not a regular file" in result[0]


def test_a_path_outside_the_root_is_refused(dirs) -> None:
    own, other = dirs
    assert "not allowed" in _refusal(other / "private.jsonl", root=own)


@pytest.mark.parametrize("big", [False, True], ids=["inline", "child process"])
@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        (b"\xff\xfe not utf-8", "not valid UTF-8"),
        ('{"prompt": "\\ud800", "answer": "x"}', "not valid UTF-8"),
        ("x" * (300 << 10), "over the limit of 262144"),
        ("[1, 2]", "row must be"),
        ("{nope", "invalid JSON"),
    ],
    ids=["deep", "bytes", "surrogate", "long", "shape", "json"],
)
def test_every_parse_failure_is_a_task_error_naming_the_line(
    tmp_path: Path, big: bool, bad: str | bytes, why: str
) -> None:
    rows = 20_000 if big else 3  # 20k rows: over the inline limit, checked in a child
    path = tmp_path / "d.jsonl"
    head = "".join(jsonl_row(f"p{i}") for i in range(rows)).encode()
    path.write_bytes(head + (bad if isinstance(bad, bytes) else bad.encode()) + b"\n")
    assert not big or path.stat().st_size > jsonl.INLINE_CHECK_BYTES
    message = _refusal(path)
    assert f"d.jsonl:{rows + 1}: " in message and why in message, message


def test_rows_are_offsets_read_again_when_sampled(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(jsonl_row("aaaa", "1") + "\n" + jsonl_row("bbbb", "2"))
    task = JsonlTask(path)
    assert [task.row(i).meta["line"] for i in range(len(task))] == ["1", "3"]
    with path.open("r+b") as f:  # rewritten in place, same size: read as it is now
        f.write(jsonl_row("cccc", "1").encode())
    assert task.row(0).text == "cccc"
    with path.open("r+b") as f:
        f.write(b"not json at all!!!!!!!!!")
    with pytest.raises(TaskError, match=r"d.jsonl:1: invalid JSON"):
        task.row(0)
    task.close()


def test_a_refresh_reads_at_most_its_budget(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(jsonl_row("first"))
    task = JsonlTask(path, refresh_bytes=64 << 10)
    with path.open("a") as f:
        f.write("".join(jsonl_row(f"p{i}") for i in range(20_000)))  # ~700 KB
    added = [task.refresh() for _ in range(4)]
    assert all(0 < n <= (64 << 10) // 20 for n in added), added
    while task.refresh():
        pass
    assert len(task) == 20_001
    task.close()


def test_an_unterminated_line_over_the_limit_is_refused_before_its_end(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(jsonl_row("ok"))
    task = JsonlTask(path)
    with path.open("a") as f:
        f.write('{"prompt": "' + "x" * (300 << 10))  # still being written, already too long
    with pytest.raises(TaskError, match=r"d.jsonl:2: line is over the limit"):
        task.refresh()
    task.close()


def test_rows_over_the_limit_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(jsonl_row(f"p{i}") for i in range(11)))
    assert "limit of 10 rows" in _refusal(path, max_rows=10)


def test_close_releases_the_descriptors(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(jsonl_row("x"))
    before = len(os.listdir("/proc/self/fd"))
    tasks = [JsonlTask(path) for _ in range(5)]
    assert len(os.listdir("/proc/self/fd")) > before
    for t in tasks:
        t.close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_blank_lines_are_skipped_and_indented_rows_kept(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("x\n".replace("x", jsonl_row("first").strip()))
    task = JsonlTask(path)
    with path.open("a") as f:
        f.write("\n   \n\t\r\n  " + jsonl_row("indented") + " \n" + jsonl_row("last"))
    task.refresh()
    assert [task.row(i).text for i in range(len(task))] == ["first", "indented", "last"]
    assert [task.row(i).meta["line"] for i in range(len(task))] == ["1", "5", "7"]
    task.close()
