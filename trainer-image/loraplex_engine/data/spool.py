"""A dataset read once, at admission, into the engine's own spool: every format but a
local JSONL file (which is read in place, tasks/jsonl.py).

The reader is a child process (data/child.py) under a time, memory and CPU bound; it
checks every row and writes them to three unlinked temporary files the engine created
(only the engine can reach them, and they vanish with it). The engine then holds only
the index, 16 bytes a row (where its prompt and its answer end), and reads a row back
from the spool when it is sampled. So
whatever the source (a Parquet file, a saved datasets directory, an object in S3), the
training loop never parses tenant bytes, never waits on the network, and cannot be made
to read a file that changed after admission.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path
from typing import Any

import numpy as np

import loraplex_engine
from loraplex_engine.data.sources import DatasetSource, LocalSource
from loraplex_engine.spec.errors import TaskError
from loraplex_engine.tenancy.data_files import DataFile, beneath

FIELD = "spec.task.dataset"
MAX_ROWS = 5_000_000  # an 80 MB index, as tasks/jsonl.py's
MAX_ROW_BYTES = 256 << 10  # a row's prompt and answer, as a JSONL line's bound
MAX_BYTES = 1 << 30  # the spool of one dataset, on the engine's temporary disk
MEMORY_BYTES = 2 << 30  # the reader's address space
READ_TIMEOUT_S = 300.0
# One record a row, written by the reader: where its prompt and its answer end.
INDEX = np.dtype([("prompt_end", "<i8"), ("answer_end", "<i8")])
_PACKAGE_ROOT = str(Path(loraplex_engine.__file__).resolve().parents[1])
# The reader imports this engine's package (not whichever one -I's site-packages holds).
_CHILD = (
    f"import sys; sys.path.insert(0, {_PACKAGE_ROOT!r}); "
    "from loraplex_engine.data.child import main; main()"
)
# What of the engine's environment the reader keeps: the locale, and botocore's settings
# that are not credentials (a workload identity's token file, a CA bundle, ...).
_KEEP_ENV = ("PATH", "LANG", "LC_ALL", "TMPDIR")


class _Files:
    """The spool's descriptors, closed with the task (or when it is collected)."""

    NAMES = ("prompts", "answers", "index")

    def __init__(self) -> None:
        # Held as long as the task: closed by close(), not by a with block.
        self.files = [
            tempfile.TemporaryFile(prefix=f"loraplex-{name}-")  # noqa: SIM115
            for name in self.NAMES
        ]
        self.fds = {name: f.fileno() for name, f in zip(self.NAMES, self.files, strict=True)}

    def close(self) -> None:
        for f in self.files:
            f.close()


class SpooledRows:
    """A dataset's rows, read through the reader process; ``row(i)`` is (prompt, answer)."""

    def __init__(
        self,
        source: DatasetSource,
        *,
        max_rows: int = MAX_ROWS,
        max_row_bytes: int = MAX_ROW_BYTES,
        max_bytes: int = MAX_BYTES,
        memory_bytes: int = MEMORY_BYTES,
        timeout_s: float = READ_TIMEOUT_S,
    ):
        self.shown = source.shown
        self.max_row_bytes = max_row_bytes
        self._files = _Files()
        weakref.finalize(self, self._files.close)
        job: dict[str, Any] = {
            "format": source.format,
            "split": source.split,
            "columns": list(source.columns),
            "shown": source.shown,
            "max_rows": max_rows,
            "max_row_bytes": max_row_bytes,
            "max_bytes": max_bytes,
            "memory_bytes": memory_bytes,
            "fds": self._files.fds,
        }
        try:
            self._read(job, source, timeout_s)
            self._index = self._load_index(max_rows)
        except BaseException:
            self._files.close()
            raise

    def _read(self, job: dict[str, Any], source: DatasetSource, timeout_s: float) -> None:
        where, held = source.where, None
        if isinstance(where, LocalSource):
            base, parts = beneath(where.path, where.base)
            held = DataFile(base, parts, source.shown, allow_hard_links=where.allow_hard_links)
            job.update(kind="local", dir_fd=held.dir_fd, parts=list(parts))
            job["hard_links"] = where.allow_hard_links
        else:
            store = where.store
            job.update(kind="object", scheme=where.url.scheme, path=where.url.path)
            job.update(endpoint_url=store.endpoint_url, region=store.region)
            job["credentials"] = dict(store.credentials)
        fds = [*job["fds"].values(), *([job["dir_fd"]] if held else [])]
        try:
            self._run(job, fds, timeout_s)
        finally:
            if held is not None:
                held.close()

    def _run(self, job: dict[str, Any], fds: list[int], timeout_s: float) -> None:
        env = {k: v for k, v in os.environ.items() if k in _KEEP_ENV or k.startswith("AWS_")}
        try:
            done = subprocess.run(
                [sys.executable, "-I", "-c", _CHILD],
                input=json.dumps(job).encode(),
                pass_fds=fds,
                capture_output=True,
                timeout=timeout_s,
                env=env,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise TaskError(FIELD, f"{self.shown}: not read within {timeout_s:.0f}s") from None
        line = done.stdout.decode("utf-8", "replace").strip().splitlines()
        if done.returncode == 0 and line:
            return
        if done.returncode == 1 and line:
            raise TaskError(FIELD, line[-1])
        how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
        raise TaskError(FIELD, f"{self.shown}: the dataset reader failed ({how})")

    def _load_index(self, max_rows: int) -> np.ndarray:
        """The index the reader wrote, checked against the spool (it is the reader's
        word, and the reader parsed the tenant's bytes)."""
        fds = self._files.fds
        size = os.fstat(fds["index"]).st_size
        if size % INDEX.itemsize or size // INDEX.itemsize > max_rows:
            raise TaskError(FIELD, f"{self.shown}: the reader's index is damaged")
        index = np.frombuffer(os.pread(fds["index"], size, 0), dtype=INDEX)
        for name, column in (("prompts", "prompt_end"), ("answers", "answer_end")):
            ends = np.concatenate(([0], index[column]))
            lengths = np.diff(ends)
            if len(index) and (lengths.min() < 0 or int(ends[-1]) > os.fstat(fds[name]).st_size):
                raise TaskError(FIELD, f"{self.shown}: the reader's index is damaged")
        return index

    def __len__(self) -> int:
        return len(self._index)

    def row(self, i: int) -> tuple[str, str]:
        p_end, a_end = self._index[i].tolist()
        p_start, a_start = self._index[i - 1].tolist() if i else (0, 0)
        if p_end - p_start + a_end - a_start > self.max_row_bytes:
            raise TaskError(FIELD, f"{self.shown}: the reader's index is damaged")
        fds = self._files.fds
        prompt = os.pread(fds["prompts"], p_end - p_start, p_start)
        answer = os.pread(fds["answers"], a_end - a_start, a_start)
        return prompt.decode("utf-8"), answer.decode("utf-8")

    def close(self) -> None:
        self._files.close()
