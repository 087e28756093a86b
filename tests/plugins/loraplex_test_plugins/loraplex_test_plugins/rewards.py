"""TRL-style reward functions: ``f(prompts, completions, **columns) -> list[float | None]``."""

from __future__ import annotations

import time


def says_target(prompts, completions, answer, **kwargs):
    """Share of a completion's words equal to its answer (the task's target word); None
    for an empty completion (TRL's "no score")."""
    out = []
    for completion, want in zip(completions, answer, strict=True):
        words = completion.split()
        out.append(sum(w == want for w in words) / len(words) if words else None)
    return out


def raises(prompts, completions, **kwargs):
    raise RuntimeError("this reward always fails")


def hangs(prompts, completions, **kwargs):
    while True:  # a busy loop: no thread of the engine could stop it
        time.monotonic()


def returns_nan(prompts, completions, **kwargs):
    return [float("nan")] * len(completions)


def too_few(prompts, completions, **kwargs):
    return [1.0] * (len(completions) - 1)
