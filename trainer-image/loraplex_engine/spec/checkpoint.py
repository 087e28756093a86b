"""``spec.checkpoint``: how often an experiment's checkpoints are written and how many
are kept (a block of spec/experiment.py's ``ExperimentSpec``, in its own module to keep
spec/experiment.py small)."""

from __future__ import annotations

from pydantic import Field

from loraplex_engine.spec.schema import Int32, SpecModel


class CheckpointSpec(SpecModel):
    """How often checkpoints are written and how many are kept."""

    every_steps: Int32 = Field(
        10,
        ge=1,
        alias="everySteps",
        description="Write a checkpoint every this many optimiser steps (the engine also "
        "writes one when the experiment is unloaded, suspended or its pod stops).",
    )
    keep: Int32 = Field(
        3,
        ge=1,
        le=1000,
        description="Checkpoints kept per run: after each write, older ones beyond this "
        "many are deleted.",
    )
