"""Prompts from a JSONL file of ``{"prompt": str, "answer": str}`` rows.

The file may grow while an experiment trains: each ``sample_prompts`` call
reads only the bytes appended since the last one. A last line still being
written (no newline yet, not valid JSON) is left for the next read.

Given ``root`` (the directory the engine allowed, tenancy/trust.py), every read first checks that
the path still resolves inside it: a file swapped for a symlink after admission does not
lead out.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path

from loraplex_engine.errors import TaskError
from loraplex_engine.tasks.base import Prompt, Task
from loraplex_engine.tasks.rewards import Reward, exact_match
from loraplex_engine.tenancy.trust import DataRoots

FIELD = "spec.task.dataset"


class JsonlTask(Task):
    name = "jsonl"
    PARAMS: Mapping[str, str] = {}

    def __init__(
        self,
        dataset: str | Path,
        params: Mapping[str, str] | None = None,
        reward: Reward | None = None,
        root: Path | None = None,
    ):
        super().__init__(params, reward)
        self.path = Path(dataset)
        self.root = root
        self._check_inside()
        if not self.path.is_file():
            raise TaskError(FIELD, f"dataset file {str(self.path)!r} does not exist")
        self.rows: list[Prompt] = []
        self._offset = 0  # bytes consumed so far
        self._line_no = 0  # newline-terminated lines consumed so far
        self._inode: int | None = None
        self.refresh()

    def refresh(self) -> int:
        """Load rows appended since the last call; returns how many were added."""
        self._check_inside()
        st = self.path.stat()
        size = st.st_size
        if size < self._offset or st.st_ino != self._inode:  # truncated or replaced
            self.rows, self._offset, self._line_no = [], 0, 0
            self._inode = st.st_ino
        if size == self._offset:
            return 0
        with self.path.open("rb") as f:
            f.seek(self._offset)
            chunk = f.read(size - self._offset)
        before = len(self.rows)
        lines = chunk.split(b"\n")
        for line in lines[:-1]:  # newline-terminated: complete
            self._line_no += 1
            self._offset += len(line) + 1
            self._add(line, self._line_no, partial=False)
        tail = lines[-1]
        if tail and self._add(tail, self._line_no + 1, partial=True):
            # A complete row without its newline yet: consume it; the newline that
            # follows later reads as an empty line.
            self._offset += len(tail)
        return len(self.rows) - before

    def _check_inside(self) -> None:
        if self.root is not None and not DataRoots.inside(self.path, self.root):
            raise TaskError(FIELD, f"dataset {str(self.path)!r} is not allowed")

    def _add(self, raw: bytes, line_no: int, partial: bool) -> bool:
        text = raw.decode("utf-8", errors="replace").strip()
        if not text:
            return False
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            if partial:
                return False  # still being written
            raise TaskError(FIELD, f"{self.path}:{line_no}: invalid JSON ({exc.msg})") from None
        if not (
            isinstance(row, dict)
            and isinstance(row.get("prompt"), str)
            and isinstance(row.get("answer"), str)
        ):
            raise TaskError(
                FIELD, f'{self.path}:{line_no}: row must be {{"prompt": str, "answer": str}}'
            )
        self.rows.append(Prompt(row["prompt"], row["answer"], meta={"line": str(line_no)}))
        return True

    def sample_prompts(self, n: int, rng: random.Random) -> list[Prompt]:
        self.refresh()
        if not self.rows:
            raise TaskError(FIELD, f"dataset {str(self.path)!r} has no rows")
        return [self.rows[rng.randrange(len(self.rows))] for _ in range(n)]

    def verify(self, completion: str, answer: str) -> float:
        return exact_match(completion, answer)
