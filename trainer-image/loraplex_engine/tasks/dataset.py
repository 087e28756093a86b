"""The ``dataset`` task: prompts and answers from a dataset in any format the engine
reads (JSONL, Parquet, a saved datasets directory), local or in object storage, with the
columns the spec maps (``task.datasetOptions``; docs/datasets.md).

A local JSONL file is read in place (tasks/jsonl.py); anything else is read once into the
engine's spool by a bounded reader process (data/spool.py).
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from loraplex_engine.data.sources import DatasetSource, LocalSource
from loraplex_engine.data.spool import SpooledRows
from loraplex_engine.spec.errors import TaskError
from loraplex_engine.tasks.base import Prompt, Task
from loraplex_engine.tasks.jsonl import JsonlTask
from loraplex_engine.tasks.rewards import Reward, exact_match

FIELD = "spec.task.dataset"


class DatasetTask(Task):
    name = "dataset"
    PARAMS: Mapping[str, str] = {}

    def __init__(
        self,
        source: DatasetSource | None = None,
        params: Mapping[str, str] | None = None,
        reward: Reward | None = None,
        **bounds: int,
    ):
        super().__init__(params, reward)
        if source is None:
            raise TaskError(FIELD, "required for task dataset")
        self.rows = SpooledRows(source, **bounds)

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, i: int) -> Prompt:
        prompt, answer = self.rows.row(i)
        return Prompt(prompt, answer, meta={"row": str(i)})

    def sample_prompts(self, n: int, rng: random.Random) -> list[Prompt]:
        if not len(self):
            raise TaskError(FIELD, f"dataset {self.rows.shown!r} has no rows")
        return [self.row(rng.randrange(len(self))) for _ in range(n)]

    def verify(self, completion: str, answer: str) -> float:
        return exact_match(completion, answer)

    def close(self) -> None:
        self.rows.close()
        super().close()


def open_dataset(source: DatasetSource, params: Mapping[str, str], reward: Reward | None) -> Task:
    """The task reading ``source``: a local JSONL file in place, anything else spooled."""
    where = source.where
    if source.format == "jsonl" and isinstance(where, LocalSource):
        return JsonlTask(
            where.path,
            params,
            reward,
            root=where.base,
            allow_hard_links=where.allow_hard_links,
            columns=source.columns,
        )
    return DatasetTask(source, params, reward)
