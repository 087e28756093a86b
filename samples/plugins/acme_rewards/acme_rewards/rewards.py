"""A reward function as TRL writes them: it works unchanged with TRL's GRPOTrainer."""

from __future__ import annotations

import re

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def format_reward(prompts, completions, answer, **columns):
    """1 for ``<answer>X</answer>`` with X the task's answer, 0.2 for the format alone,
    0 otherwise. ``answer`` is the task's answer column; other dataset columns arrive by
    name in ``columns``."""
    scores = []
    for completion, want in zip(completions, answer, strict=True):
        found = ANSWER.search(completion)
        if found is None:
            scores.append(0.0)
        else:
            scores.append(1.0 if found.group(1).strip() == want.strip() else 0.2)
    return scores
