"""Prompts from a JSONL file of ``{"prompt": str, "answer": str}`` rows (or the keys
``columns`` names: the dataset task's ``datasetOptions.columns``).

Bounded whatever the file holds (issue 26; docs/architecture.md, "Tenancy and trust"):

- the file is opened beneath its allowed directory without following a link, and read
  only through that descriptor (tenancy/data_files.py);
- rows are an index of file offsets (16 bytes a row, at most ``max_rows``), each row read
  again and parsed when it is sampled: the engine never holds the dataset's text;
- a line over ``max_line_bytes`` is refused before it is decoded;
- at admission every line is checked (a big file in a child process: the parse neither
  holds the engine's GIL nor grows its memory), any failure a TaskError naming the line;
- the file may grow while an experiment trains: each ``sample_prompts`` indexes at most
  ``refresh_bytes`` of the bytes appended since (newlines found by numpy, no parse: a row
  appended later is checked when it is first sampled). A last line still being written
  (no newline yet, not valid JSON) is left for the next read; a truncated or replaced file
  (a new inode, opened through the same walk) is read again from its start.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import weakref
from array import array
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from loraplex_engine.data import jsonl_rows
from loraplex_engine.spec.errors import TaskError
from loraplex_engine.tasks.base import Prompt, Task
from loraplex_engine.tasks.rewards import Reward, exact_match
from loraplex_engine.tenancy.data_files import DataFile, beneath

FIELD = "spec.task.dataset"
# Defaults (docs/architecture.md, "Tenancy and trust"): a prompt at the 1,024-token limit is
# ~4-30 KB of JSON; 256 KiB leaves room for long answers and parses in about a millisecond.
MAX_LINE_BYTES = 256 << 10
# Indexing 1 MiB of appended lines takes a few ms of the tick (numpy, no parse); more waits
# for the experiment's next step, so a fast-growing file paces only its own experiment.
REFRESH_BYTES = 1 << 20
MAX_ROWS = 5_000_000  # an 80 MB index
INLINE_CHECK_BYTES = 256 << 10  # smaller files are checked in-process (~25 ms)
TAIL_PARSE_BYTES = 64 << 10  # a longer last line without its newline waits for it
CHECK_TIMEOUT_S = 120.0
_CHUNK = 1 << 20
_TEXT = np.ones(256, dtype=bool)  # byte -> not blank
_TEXT[list(jsonl_rows.BLANK)] = False


class _Handles:
    """The open descriptors, closed by :meth:`JsonlTask.close` or when it is collected."""

    def __init__(self, data: DataFile) -> None:
        self.data = data
        self.fd: int | None = None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.data.close()


class JsonlTask(Task):
    name = "jsonl"
    PARAMS: Mapping[str, str] = {}

    def __init__(
        self,
        dataset: str | Path,
        params: Mapping[str, str] | None = None,
        reward: Reward | None = None,
        root: Path | None = None,
        *,
        allow_hard_links: bool = False,
        max_line_bytes: int = MAX_LINE_BYTES,
        refresh_bytes: int = REFRESH_BYTES,
        max_rows: int = MAX_ROWS,
        columns: tuple[str, str] = jsonl_rows.KEYS,
    ):
        super().__init__(params, reward)
        self.path = Path(dataset)
        self.columns = columns  # the keys of the prompt and the answer
        self.max_line_bytes, self.refresh_bytes, self.max_rows = (
            max_line_bytes, refresh_bytes, max_rows
        )  # fmt: skip
        base, parts = beneath(self.path, root)
        self._h = _Handles(DataFile(base, parts, str(self.path), allow_hard_links=allow_hard_links))
        weakref.finalize(self, self._h.close)
        self._identity: tuple[int, int] | None = None
        self._reset()
        try:
            self._advance(None, check=True)
        except BaseException:
            self._h.close()
            raise

    def _reset(self) -> None:
        self._offsets = array("q")  # byte offset of each row
        self._lengths = array("I")  # its bytes, newline excluded
        self._lines = array("I")  # its line number
        self._offset = 0  # bytes consumed so far
        self._line_no = 0  # newline-terminated lines consumed so far
        self._tail_tried = -1  # length of the unterminated last line parsed in vain

    def __len__(self) -> int:
        return len(self._offsets)

    def refresh(self) -> int:
        """Index rows appended since the last call (at most ``refresh_bytes``); returns
        how many were added."""
        return self._advance(self.refresh_bytes, check=False)

    def _advance(self, budget: int | None, check: bool) -> int:
        fd, st = self._h.data.open()
        identity = (st.st_dev, st.st_ino)
        if self._h.fd is not None and identity == self._identity and st.st_size >= self._offset:
            os.close(fd)  # the same file: keep reading the descriptor the index is of
        else:  # first read, or truncated or replaced
            if self._h.fd is not None:
                os.close(self._h.fd)
            self._h.fd, self._identity = fd, identity
            self._reset()
        end = st.st_size if budget is None else min(st.st_size, self._offset + budget)
        if check:
            self._check(end)
        before = len(self)
        self._index(end, at_eof=end == st.st_size)
        return len(self) - before

    def _check(self, end: int) -> None:
        """Every line before ``end`` is a row; a TaskError naming the first that is not."""
        assert self._h.fd is not None
        if end <= INLINE_CHECK_BYTES:
            problem = jsonl_rows.check_file(self._h.fd, end, self.max_line_bytes, self.columns)
        else:
            problem = self._check_in_child(self._h.fd, end)
        if problem is not None:
            raise TaskError(FIELD, f"{self.path}:{problem}")

    def _check_in_child(self, fd: int, end: int) -> str | None:
        args = [sys.executable, "-I", jsonl_rows.__file__, str(fd), str(end)]
        try:
            done = subprocess.run(
                [*args, str(self.max_line_bytes), *self.columns],
                pass_fds=(fd,),
                capture_output=True,
                timeout=CHECK_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return f" not checked: over {CHECK_TIMEOUT_S:.0f}s to read"
        if done.returncode == 0:
            return None
        text = done.stdout.decode("utf-8", "replace").strip()
        return text if done.returncode == 1 and text else f" not checked (exit {done.returncode})"

    def _index(self, end: int, at_eof: bool) -> None:
        """Index the newline-terminated lines from the consumed offset up to ``end``."""
        fd = self._h.fd
        assert fd is not None
        chunk = max(_CHUNK, self.max_line_bytes + 1)
        while self._offset < end:
            want = min(chunk, end - self._offset)
            buf = os.pread(fd, want, self._offset)
            data = np.frombuffer(buf, np.uint8)
            ends = np.flatnonzero(data == 10)
            if ends.size:
                self._add_lines(data, ends)
            if len(buf) < want or not ends.size:
                break  # the file shrank, or a line longer than a chunk: _tail refuses it
        self._tail(end, at_eof)

    def _add_lines(self, data: np.ndarray, ends: np.ndarray) -> None:
        starts = np.concatenate(([0], ends[:-1] + 1))
        lengths = ends - starts
        long = np.flatnonzero(lengths > self.max_line_bytes)
        if long.size:
            line = self._line_no + int(long[0]) + 1
            raise TaskError(
                FIELD,
                f"{self.path}:{line}: line of {int(lengths[long[0]])} bytes is over the "
                f"limit of {self.max_line_bytes}",
            )
        # Blank lines are skipped. A line whose first byte is not blank is not; only the
        # others (rare: indented) need a pass over their bytes.
        keep = _TEXT[data[starts]] & (lengths > 0)
        maybe = np.flatnonzero(~keep & (lengths > 0))
        if maybe.size:
            filled = np.concatenate(([0], np.cumsum(_TEXT[data], dtype=np.int32)))
            keep[maybe] = filled[ends[maybe]] - filled[starts[maybe]] > 0
        if len(self) + int(keep.sum()) > self.max_rows:
            raise TaskError(FIELD, f"{self.path}: over this engine's limit of {self.max_rows} rows")
        self._offsets.frombytes((starts[keep] + self._offset).astype(np.int64).tobytes())
        self._lengths.frombytes(lengths[keep].astype(np.uint32).tobytes())
        numbers = np.flatnonzero(keep) + self._line_no + 1
        self._lines.frombytes(numbers.astype(np.uint32).tobytes())
        self._offset += int(ends[-1]) + 1
        self._line_no += len(ends)

    def _tail(self, end: int, at_eof: bool) -> None:
        """The last line has no newline yet: over the line limit, it is refused now; a
        complete row (it parses) is taken, and the newline that follows later reads as an
        empty line; anything else waits for more bytes."""
        size = end - self._offset
        if size > self.max_line_bytes:
            raise TaskError(
                FIELD,
                f"{self.path}:{self._line_no + 1}: line is over the limit of "
                f"{self.max_line_bytes} bytes",
            )
        if not at_eof or size == 0 or size > TAIL_PARSE_BYTES or size == self._tail_tried:
            return
        assert self._h.fd is not None
        raw = os.pread(self._h.fd, size, self._offset)
        if not raw.strip(jsonl_rows.BLANK) or isinstance(
            jsonl_rows.parse_row(raw, self.columns), str
        ):
            self._tail_tried = size
            return
        self._offsets.append(self._offset)
        self._lengths.append(size)
        self._lines.append(self._line_no + 1)
        self._offset += size

    def row(self, i: int) -> Prompt:
        """Row ``i``, read again from the file; TaskError naming its line if it is no
        longer a row (the file was rewritten in place)."""
        assert self._h.fd is not None
        length, line = self._lengths[i], self._lines[i]
        raw = os.pread(self._h.fd, length, self._offsets[i])
        parsed = (
            jsonl_rows.parse_row(raw, self.columns)
            if len(raw) == length
            else "changed since it was read"
        )
        if isinstance(parsed, str):
            raise TaskError(FIELD, f"{self.path}:{line}: {parsed}")
        return Prompt(parsed[0], parsed[1], meta={"line": str(line)})

    def sample_prompts(self, n: int, rng: random.Random) -> list[Prompt]:
        self.refresh()
        if not len(self):
            raise TaskError(FIELD, f"dataset {str(self.path)!r} has no rows")
        return [self.row(rng.randrange(len(self))) for _ in range(n)]

    def verify(self, completion: str, answer: str) -> float:
        return exact_match(completion, answer)

    def close(self) -> None:
        self._h.close()
        super().close()
