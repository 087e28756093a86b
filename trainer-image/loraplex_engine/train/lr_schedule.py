"""Learning-rate schedules of one adapter, as a pure function of its own step count.

Each adapter's schedule is driven by the optimiser steps *that adapter* has taken (the
step count its optimiser state carries and its checkpoints save), never by the engine's
tick: tenants that joined at different times, or were suspended, each sit at their own
point of their own schedule, and a resume continues where the checkpoint stopped.
"""

from __future__ import annotations

import math

from loraplex_engine.spec.algorithm import LR_SCHEDULES


def lr_factor(step: int, schedule: str, warmup_steps: int = 0, total_steps: int = 0) -> float:
    """Multiplier of the base learning rate for the adapter's ``step``-th update (1-based).

    - warmup (both schedules): updates 1..warmup_steps ramp linearly, step / warmup_steps,
      so update warmup_steps is the first at the full rate;
    - ``constant``: 1 after the warmup;
    - ``cosine``: after the warmup, a half cosine over the remaining
      ``total_steps - warmup_steps`` updates, 1 at the first and approaching 0 at the
      last (torch's CosineAnnealingLR with T_max = total_steps - warmup_steps and
      eta_min = 0): the last update still moves the weights.

    ``cosine`` needs a run length: ``total_steps`` > ``warmup_steps`` (the spec refuses
    cosine for a continual run, maxSteps 0).
    """
    if step < 1:
        raise ValueError(f"step counts updates from 1, got {step}")
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; known: {LR_SCHEDULES}")
    if step <= warmup_steps:
        return step / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = total_steps - warmup_steps
    if decay_steps < 1:
        raise ValueError(
            f"cosine needs total_steps ({total_steps}) > warmup_steps ({warmup_steps})"
        )
    # Past the end (a finished run stepped further) the rate stays at the last value.
    progress = min(step - warmup_steps - 1, decay_steps - 1) / decay_steps
    return 0.5 * (1.0 + math.cos(math.pi * progress))
