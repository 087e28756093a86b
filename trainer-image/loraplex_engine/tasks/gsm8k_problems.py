"""A seeded generator of GSM8K-style grade-school math word problems.

No dataset download is possible where the engine is built, so the workload is generated:
a scenario (who, what they count) and a chain of 1..N steps on a running integer, each
step one sentence of the question and one line of the solution. Solutions are written
the way GSM8K writes them (``<<48/2=24>>`` calculator annotations, the final line
``#### 24``), so the same reward and tools work on the real dataset's rows.

Pure and deterministic: every choice comes from the ``random.Random`` passed in.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

# (who, pronoun, what they count): words a small model's tokenizer knows.
SCENARIOS = (
    ("Tom", "He", "apples"),
    ("Sara", "She", "stickers"),
    ("Liam", "He", "marbles"),
    ("Mia", "She", "books"),
    ("Noah", "He", "cards"),
    ("Emma", "She", "shells"),
    ("A baker", "She", "cookies"),
    ("A farmer", "He", "eggs"),
)
FACTORS = (2, 3, 4, 5)
MAX_VALUE = 10**6  # no step grows the running count past this (answers stay small)


@dataclass(frozen=True)
class Problem:
    question: str
    solution: str  # GSM8K's answer column: the steps, then "#### <answer>"
    answer: int
    steps: int


@dataclass
class _Chain:
    who: str
    pronoun: str
    item: str
    value: int
    sentences: list[str]
    lines: list[str]

    def record(self, sentence: str, line: str, value: int) -> None:
        self.sentences.append(sentence)
        self.lines.append(line)
        self.value = value


def _start(chain: _Chain, rng: random.Random, hi: int) -> None:
    """What they have at first: a plain count (no step), or boxes of items (one step)."""
    if rng.random() < 0.5:
        chain.sentences.append(f"{chain.who} has {(n := rng.randint(2, hi))} {chain.item}.")
        chain.value = n
        return
    boxes, each = rng.randint(2, max(2, hi // 5)), rng.randint(2, 12)
    total = boxes * each
    chain.record(
        f"{chain.who} has {boxes} boxes with {each} {chain.item} in each box.",
        f"{chain.who} has {boxes}*{each} = <<{boxes}*{each}={total}>>{total} {chain.item}.",
        total,
    )


def _add(chain: _Chain, rng: random.Random, hi: int) -> bool:
    x = rng.randint(1, hi)
    new = chain.value + x
    chain.record(
        f"{chain.pronoun} buys {x} more {chain.item}.",
        f"After buying more: {chain.value}+{x} = <<{chain.value}+{x}={new}>>{new}.",
        new,
    )
    return True


def _sub(chain: _Chain, rng: random.Random, hi: int) -> bool:
    if chain.value < 2:
        return False
    x = rng.randint(1, min(hi, chain.value - 1))
    new = chain.value - x
    chain.record(
        f"{chain.pronoun} gives {x} {chain.item} to a friend.",
        f"After giving some away: {chain.value}-{x} = <<{chain.value}-{x}={new}>>{new}.",
        new,
    )
    return True


def _mul(chain: _Chain, rng: random.Random, hi: int) -> bool:
    k = rng.choice(FACTORS)
    new = chain.value * k
    if new > MAX_VALUE:
        return False
    chain.record(
        f"Then the number of {chain.item} becomes {k} times as large.",
        f"Now {chain.value}*{k} = <<{chain.value}*{k}={new}>>{new}.",
        new,
    )
    return True


def _div(chain: _Chain, rng: random.Random, hi: int) -> bool:
    ways = [k for k in range(2, 10) if chain.value % k == 0 and chain.value // k >= 1]
    if not ways:
        return False
    k = rng.choice(ways)
    new = chain.value // k
    chain.record(
        f"{chain.pronoun} splits the {chain.item} equally into {k} bags and keeps one bag.",
        f"One bag holds {chain.value}/{k} = <<{chain.value}/{k}={new}>>{new}.",
        new,
    )
    return True


STEPS: tuple[Callable[[_Chain, random.Random, int], bool], ...] = (_add, _sub, _mul, _div)


def generate(rng: random.Random, min_steps: int = 1, max_steps: int = 3, hi: int = 50) -> Problem:
    """One problem of ``min_steps..max_steps`` arithmetic steps, numbers up to ``hi``."""
    if not 1 <= min_steps <= max_steps:
        raise ValueError(f"need 1 <= min_steps <= max_steps, got {min_steps}, {max_steps}")
    who, pronoun, item = rng.choice(SCENARIOS)
    chain = _Chain(who, pronoun, item, 0, [], [])
    want = rng.randint(min_steps, max_steps)
    _start(chain, rng, hi)
    while len(chain.lines) < want:
        # _add always applies, so the loop ends whatever the others refuse.
        while not rng.choice(STEPS)(chain, rng, hi):
            pass
    named = "the " + who[2:] if who.startswith("A ") else who
    question = " ".join(chain.sentences) + f" How many {item} does {named} have now?"
    solution = "\n".join([*chain.lines, f"#### {chain.value}"])
    return Problem(question, solution, chain.value, want)
