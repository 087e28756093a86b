"""An experiment's eval set and the rollout rows of one eval (docs/evaluation.md).

The set is fixed when the experiment is built (outside the engine's model lock): drawn
from the task with a seed of its own, or the first rows of ``spec.eval.dataset``
(eval_data.py: read as task.dataset is). Every eval samples the same prompts, so its
numbers are comparable step to step and run to run.
The rows of one eval ride in the tick's rollout batch beside the experiment's step
(tick/tick.py) under a sampling group of their own: they never train, and they draw no
randomness from the training samples' generator.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraplex_engine.evaluation.eval_data import FIELD, eval_dataset_rows
from loraplex_engine.evaluation.fit import check_eval_fits
from loraplex_engine.rollout.base import RolloutRequest
from loraplex_engine.spec.errors import TaskError
from loraplex_engine.spec.eval import EvalSpec
from loraplex_engine.spec.eval_scores import EVAL_SEED_SALT, eval_seed
from loraplex_engine.spec.experiment import ExperimentSpec
from loraplex_engine.tasks import Prompt, Task
from loraplex_engine.tenancy.trust import TrustPolicy

EVAL_GROUP_SUFFIX = "~eval"  # its rows' sampling group: "<experiment id>~eval"


@dataclass(frozen=True)
class EvalSet:
    spec: EvalSpec
    prompts: tuple[Prompt, ...]


@dataclass(frozen=True)
class EvalRows:
    """One eval's rows: each prompt ``samples`` times, in prompt order."""

    step: int  # the adapter they sample: after this many optimiser steps
    prompts: list[Prompt]
    requests: list[RolloutRequest]

    @property
    def cost(self) -> int:
        """Tokens the rows may take (prompt + token limit), as a step's cost counts."""
        return sum(len(r.prompt_ids) + r.max_new_tokens for r in self.requests)


def build_eval_set(
    spec: ExperimentSpec, task: Task, trust: TrustPolicy, namespace: str
) -> EvalSet | None:
    """``spec``'s eval set (None: no spec.eval); a TaskError names the field at fault."""
    ev = spec.evaluation
    if ev is None:
        return None
    check_eval_fits(spec)
    if ev.dataset is None:
        rng = random.Random(spec.algorithm.seed ^ EVAL_SEED_SALT)
        return EvalSet(ev, tuple(task.sample_prompts(ev.prompts, rng)))
    return EvalSet(ev, tuple(eval_dataset_rows(ev, trust, namespace)))


def eval_rows(
    exp_id: str,
    eval_set: EvalSet,
    step: int,
    seed: int,
    rollout: tuple[int, int, bool],
    encode: Callable[[Prompt], list[int]],
) -> EvalRows:
    """The rows of the eval at ``step``: ``rollout`` is the experiment's adapter slot,
    maxNewTokens and reproducible; ``encode`` a prompt's tokens (the tick's checks)."""
    ev = eval_set.spec
    slot, max_new_tokens, reproducible = rollout
    # Greedy rows draw nothing; sampled ones from a generator of this eval's own.
    generator = None
    if ev.temperature > 0:
        generator = torch.Generator().manual_seed(eval_seed(seed, step))
    prompts, requests = [], []
    for prompt in eval_set.prompts:
        try:
            ids = encode(prompt)
        except TaskError as e:  # too long for this engine: name the eval's source
            raise TaskError(FIELD if ev.dataset else e.field, f"eval: {e.message}") from None
        for _ in range(ev.samples):
            prompts.append(prompt)
            requests.append(
                RolloutRequest(
                    slot=slot,
                    prompt_ids=ids,
                    max_new_tokens=max_new_tokens,
                    temperature=ev.temperature,
                    generator=generator,
                    group=exp_id + EVAL_GROUP_SUFFIX,
                    adapter=exp_id,
                    # A sampled eval is seeded on vLLM too: it is small, and an eval that
                    # changes run to run would hide what the adapter learned.
                    reproducible=reproducible or generator is not None,
                )
            )
    return EvalRows(step, prompts, requests)
