"""The rows of ``spec.eval.dataset``, read as task.dataset is (any format and source,
under the same rules: data/sources.py, tenancy/trust.py). Free of torch: the engine's
PUT reads them into the eval set (eval_set.py) and `loraplex-engine run` reads them
before its model loads (plan/admission.py), with the same errors."""

from __future__ import annotations

from loraplex_engine.data.sources import resolve_dataset
from loraplex_engine.spec.errors import TaskError
from loraplex_engine.spec.eval import EvalSpec
from loraplex_engine.tasks.base import Prompt, Task
from loraplex_engine.tasks.dataset import DatasetTask, open_dataset
from loraplex_engine.tasks.jsonl import JsonlTask
from loraplex_engine.tenancy.trust import TrustPolicy

FIELD = "spec.eval.dataset"


def eval_dataset_rows(ev: EvalSpec, trust: TrustPolicy, namespace: str) -> list[Prompt]:
    """The first ``prompts`` rows of the eval dataset, the file checked whole; a TaskError
    naming the eval's own field (spec.eval.dataset, spec.eval.datasetOptions...)."""
    assert ev.dataset is not None
    data: Task | None = None
    try:
        source = resolve_dataset(trust, ev.dataset, ev.dataset_options, namespace)
        data = open_dataset(source, {}, None)
        assert isinstance(data, JsonlTask | DatasetTask)  # what open_dataset opens: rows
        if not len(data):
            raise TaskError(FIELD, f"eval dataset {ev.dataset!r} has no rows")
        return [data.row(i) for i in range(min(ev.prompts, len(data)))]
    except TaskError as e:  # the rules are task.dataset's: name the eval's own fields
        raise TaskError(e.field.replace("spec.task.", "spec.eval.", 1), e.message) from None
    finally:
        if data is not None:
            data.close()
