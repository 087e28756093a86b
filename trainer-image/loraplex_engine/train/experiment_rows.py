"""One experiment's sampled step to its training rows: the algorithm shapes the rewards,
estimates the advantages and filters the groups (train/algorithms/advantages.py), and
each kept completion becomes a ``TrainRow`` of the fused update (train/step.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex_engine.train.algorithms import Algorithm, PolicyLoss, StepAdvantages
from loraplex_engine.train.rows import TrainRow


@dataclass(frozen=True)
class Sample:
    """One completion of the step, in the step's order (groups contiguous)."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    temperature: float
    mask: list[int] | None = None  # a multi-turn episode's: its observations are not trained


@dataclass(frozen=True)
class ExperimentRows:
    rows: list[TrainRow]
    step: StepAdvantages

    @property
    def skipped(self) -> bool:
        """No row trains: every group dropped (or every completion empty)."""
        return not self.rows


def experiment_rows(
    exp_id: str,
    slot: int,
    algorithm: Algorithm,
    group_size: int,
    samples: Sequence[Sample],
    rewards: Sequence[float],
) -> ExperimentRows:
    """The rows that train, with their advantages; rows of a dropped group and empty
    completions (nothing to score) are left out."""
    lengths = [len(s.token_ids) for s in samples]
    step = algorithm.step_advantages(torch.tensor(rewards), lengths, group_size)
    rows: list[TrainRow] = []
    # Prompt group = identical prompt tokens within this experiment's step (its
    # groupSize samples, and any prompt drawn twice): they share one prefix.
    groups: dict[tuple[int, ...], int] = {}
    for s, a, keep in zip(samples, step.advantages.tolist(), step.keep.tolist(), strict=True):
        if s.token_ids and keep:
            group = groups.setdefault(tuple(s.prompt_ids), len(groups))
            rows.append(
                TrainRow(
                    exp_id,
                    slot,
                    s.prompt_ids,
                    s.token_ids,
                    s.logprobs,
                    a,
                    s.temperature,
                    group,
                    mask=s.mask,
                )
            )
    return ExperimentRows(rows, step)


def step_loss(algorithm: Algorithm, rows: Sequence[TrainRow]) -> PolicyLoss:
    """The experiment's loss for this step's rows (a token-mean loss needs their tokens)."""
    return algorithm.loss.for_step([len(r.completion_ids) for r in rows])
