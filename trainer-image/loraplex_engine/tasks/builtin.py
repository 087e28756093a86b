"""Built-in tasks that a tiny random model learns in tens of steps on CPU.

Prompts use words the tiny model's tokenizer knows (tiny_model._training_corpus),
so they encode to few tokens.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping

from loraplex_engine.spec.errors import TaskError
from loraplex_engine.tasks.base import Prompt, Task, bool_param, int_param
from loraplex_engine.tasks.rewards import coverage, prefix_overlap

FILLER_WORDS = ("the", "answer", "is", "token", "repeat", "of", "copy", "sum", "say")


class TargetTokenTask(Task):
    """Emit the target word. Default reward: ``coverage`` of the completion by it.

    A share (not all-or-nothing) gives a random policy nonzero signal and keeps
    rising as the policy says the target more often, while staying verifiable.
    """

    name = "target-token"
    PARAMS: Mapping[str, str] = {"target": "yes"}

    @classmethod
    def check_params(cls, params: Mapping[str, str]) -> None:
        target = params["target"]
        if not target or any(ch.isspace() for ch in target):
            raise TaskError("spec.task.params.target", "must be one non-empty word")

    def sample_prompts(self, n: int, rng: random.Random) -> list[Prompt]:
        target = self.params["target"]
        out = []
        for _ in range(n):
            filler = " ".join(rng.choice(FILLER_WORDS) for _ in range(2))
            out.append(Prompt(text=f"{filler} say {target}:", answer=target))
        return out

    def verify(self, completion: str, answer: str) -> float:
        return coverage(completion, answer)


class CopyTask(Task):
    """Repeat a short random string. Reward: in-place character overlap at the start."""

    name = "copy"
    PARAMS: Mapping[str, str] = {"length": "3", "alphabet": "abc"}

    @classmethod
    def check_params(cls, params: Mapping[str, str]) -> None:
        int_param(params, "length", 1, 64)
        alphabet = params["alphabet"]
        if not alphabet or any(ch.isspace() for ch in alphabet):
            raise TaskError("spec.task.params.alphabet", "must be non-empty, without spaces")

    def sample_prompts(self, n: int, rng: random.Random) -> list[Prompt]:
        length = int_param(self.params, "length", 1, 64)
        alphabet = self.params["alphabet"]
        out = []
        for _ in range(n):
            s = "".join(rng.choice(alphabet) for _ in range(length))
            out.append(Prompt(text=f"copy {s}:", answer=s))
        return out

    def verify(self, completion: str, answer: str) -> float:
        return prefix_overlap(completion, answer)


_FIRST_INT = re.compile(r"-?\d+")


class ArithmeticTask(Task):
    """``a + b =`` with a, b in [0, maxOperand]. Reward: the first integer is the sum.

    ``partialCredit: "true"`` adds in-place digit credit (for weak models).
    """

    name = "arithmetic"
    PARAMS: Mapping[str, str] = {"maxOperand": "9", "partialCredit": "false"}

    @classmethod
    def check_params(cls, params: Mapping[str, str]) -> None:
        int_param(params, "maxOperand", 0, 10**6)
        bool_param(params, "partialCredit")

    def sample_prompts(self, n: int, rng: random.Random) -> list[Prompt]:
        hi = int_param(self.params, "maxOperand", 0, 10**6)
        out = []
        for _ in range(n):
            a, b = rng.randint(0, hi), rng.randint(0, hi)
            out.append(Prompt(text=f"{a} + {b} =", answer=str(a + b)))
        return out

    def verify(self, completion: str, answer: str) -> float:
        match = _FIRST_INT.search(completion)
        if match and match.group() == answer:
            return 1.0
        if not bool_param(self.params, "partialCredit"):
            return 0.0
        # Partial credit: digits in place at the start, capped below a correct answer.
        return 0.5 * prefix_overlap(completion, answer)


# Everyday questions an instruct model answers at length unless taught otherwise.
SHORT_REPLY_QUESTIONS = (
    "What color is the sky?",
    "Name a fruit.",
    "What is the capital of France?",
    "How many legs does a dog have?",
    "What do bees make?",
    "Which animal says moo?",
    "What is frozen water called?",
    "Name a day of the week.",
    "What do you drink in the morning?",
    "Where do fish live?",
    "What is the opposite of hot?",
    "Name a musical instrument.",
)


def brevity(completion: str, max_words: int) -> float:
    """1 for a reply of 1..max_words words, else max_words / words (0 for an empty one).

    Dense: a rambling reply cut off at the token limit still scores a little, and every
    word fewer scores more, so a model that always answers at length has a gradient."""
    words = len(completion.split())
    if words == 0:
        return 0.0
    return min(1.0, max_words / words)


class ShortReplyTask(Task):
    """Answer an everyday question in at most ``maxWords`` words. Reward: ``brevity``.

    A length target a small instruct model learns in tens of steps (it ends its turn
    sooner), meant for ``task.chatTemplate: true``; the answer is not checked."""

    name = "short-reply"
    PARAMS: Mapping[str, str] = {"maxWords": "5"}

    @classmethod
    def check_params(cls, params: Mapping[str, str]) -> None:
        int_param(params, "maxWords", 1, 1000)

    def sample_prompts(self, n: int, rng: random.Random) -> list[Prompt]:
        limit = self.params["maxWords"]
        return [
            Prompt(
                text=f"{rng.choice(SHORT_REPLY_QUESTIONS)} Answer in at most {limit} words.",
                answer=limit,
            )
            for _ in range(n)
        ]

    def verify(self, completion: str, answer: str) -> float:
        return brevity(completion, int(answer))
