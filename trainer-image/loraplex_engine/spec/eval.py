"""``spec.eval``: an experiment's evaluation, run every few steps on a fixed prompt set
(issue 30 item 6; docs/evaluation.md).

Bounded because a tenant writes it: at most MAX_EVAL_PROMPTS prompts and MAX_EVAL_SAMPLES
completions each, and the engine counts an eval's rows in the step cost it admits
(tenancy/work_limits.py) and in the fair share of the tick that runs it. A block of
spec/experiment.py's ``ExperimentSpec``, in its own module to keep spec/experiment.py
small; free of I/O.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from loraplex_engine.spec.data_options import DatasetOptions
from loraplex_engine.spec.schema import CelRule, Int32, SpecModel

MAX_EVAL_PROMPTS = 64
MAX_EVAL_SAMPLES = 16
MAX_EVAL_EVERY_STEPS = 1_000_000
# A reward is any finite number (an http reward's scale is the tenant's), so is the bar.
MAX_PASS_THRESHOLD = 1e9

# spec-level rule (ExperimentSpec.CEL_RULES): an eval scores with the task's reward.
EVAL_NEEDS_TASK = CelRule(
    "!has(self.eval) || has(self.task)",
    "spec.eval scores completions with spec.task's reward: a client experiment (spec.client) "
    "has none; leave spec.eval unset",
    "eval",
    lambda spec: spec.evaluation is None or spec.task is not None,
)


class EvalSpec(SpecModel):
    """A fixed set of prompts sampled with the adapter every everySteps steps (at step 0,
    the untrained adapter, and after the last step too), scored with the task's reward:
    the mean reward and pass@k land in the experiment's status, metrics and trackers. Its
    completions never train. Mutable, like checkpoint: the next placement takes it."""

    CEL_RULES: ClassVar = (
        CelRule(
            "!has(self.passAtK) || self.passAtK <= (has(self.samples) ? self.samples : 1)",
            "eval.passAtK must be at most eval.samples (pass@k needs k of the n completions "
            "sampled per prompt)",
            "passAtK",
            lambda ev: ev.pass_at_k <= ev.samples,
        ),
        CelRule(
            "!has(self.samples) || self.samples == 1 || "
            "(has(self.temperature) && self.temperature > 0.0)",
            "eval.samples > 1 needs eval.temperature > 0: greedy completions of one prompt "
            "are all the same",
            "samples",
            lambda ev: ev.samples == 1 or ev.temperature > 0,
        ),
    )

    every_steps: Int32 = Field(
        10,
        ge=1,
        le=MAX_EVAL_EVERY_STEPS,
        alias="everySteps",
        description="Evaluate the adapter at step 0 and every this many optimiser steps, "
        "and once more after the last step (algorithm.maxSteps).",
    )
    prompts: Int32 = Field(
        16,
        ge=1,
        le=MAX_EVAL_PROMPTS,
        description="Prompts in the eval set: drawn once from the task (with a seed derived "
        "from algorithm.seed, so the same prompts every eval and every run), or the first "
        "this many rows of dataset.",
    )
    dataset: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="A dataset read as task.dataset is (JSONL, Parquet or a saved datasets "
        "directory; from the pool's dataRoots, relative: under <root>/<namespace>/, or "
        "object storage within the namespace's prefix): the eval set is its first `prompts` "
        "rows, scored with the task's reward. Absent = prompts drawn from the task itself.",
    )
    dataset_options: DatasetOptions | None = Field(
        None,
        alias="datasetOptions",
        description="How eval.dataset is read: its format, split and the columns of the "
        "prompt and the answer, as task.datasetOptions. Absent = from its name, columns "
        "prompt and answer.",
    )
    samples: Int32 = Field(
        1,
        ge=1,
        le=MAX_EVAL_SAMPLES,
        description="Completions sampled per eval prompt (n of pass@k). More than 1 needs "
        "temperature > 0.",
    )
    pass_at_k: Int32 = Field(
        1,
        ge=1,
        le=MAX_EVAL_SAMPLES,
        alias="passAtK",
        description="k of pass@k: the chance that at least one of k completions of a prompt "
        "passes, estimated without bias from the n = samples drawn, averaged over the "
        "prompts. At most samples.",
    )
    temperature: float = Field(
        0.0,
        ge=0,
        le=2,
        description="Sampling temperature of the eval's completions; 0 = greedy. Sampled "
        "evals are seeded from algorithm.seed and the step: the same every run.",
    )
    pass_threshold: float = Field(
        1.0,
        ge=-MAX_PASS_THRESHOLD,
        le=MAX_PASS_THRESHOLD,
        alias="passThreshold",
        description="A completion passes when its reward is at least this (1.0: a correct "
        "answer of a binary task).",
    )
