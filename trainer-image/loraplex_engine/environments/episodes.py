"""One experiment's multi-turn episodes of a step: their rows and their bookkeeping.

An episode's row is its prompt, then the policy's sampled token ids with their
log-probs, exactly as sampled (never re-tokenised), interleaved with the environment's
observations, encoded (observations.py: plain text, or chat messages through the
tokenizer's template) and masked out of the loss (``Completion.mask`` 0). Bounds: the
spec's ``maxTurns`` (an episode still going is cut there, scored by its turns so far:
an environment that never ends costs its experiment that, nothing else) and its
``maxEpisodeTokens`` (each turn samples at most what is left; an observation is cut to
leave the policy a token).

Pure bookkeeping, no I/O: the environment's calls (its worker's round trips) are made by
player.py, which plays every experiment's groups, each at its environment's pace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from loraplex_engine.environments.base import Step
from loraplex_engine.environments.session import EnvironmentSession
from loraplex_engine.rollout.base import Completion, RolloutRequest

# An observation's ids, given the policy's latest turn (its sampled ids), the step and the
# room left in the episode (the result is cut to it).
Observe = Callable[[list[int], Step, int], list[int]]


@dataclass
class Episode:
    id: int  # the environment session's
    request: RolloutRequest  # its first turn's: the prompt, the adapter, how to sample
    budget: int  # tokens it may add after its prompt
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    done: bool = False
    cut: bool = False  # ended by a bound, not by the environment
    turn_start: int = 0  # where the latest policy turn begins in ``ids``

    def take(self, c: Completion) -> None:
        self.turn_start = len(self.ids)
        self.ids += c.token_ids
        self.logprobs += c.logprobs
        self.mask += [1] * len(c.token_ids)
        self.turns += 1

    def observe(self, ids: list[int]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)  # not the policy's: masked out
        self.mask += [0] * len(ids)

    def last_turn(self) -> list[int]:
        return self.ids[self.turn_start :]

    def next_request(self) -> RolloutRequest:
        """This episode's next turn; its first (the prompt alone) before it has one."""
        if not self.turns:
            return self.request
        left = self.budget - len(self.ids)
        return dataclasses.replace(
            self.request,
            prompt_ids=self.request.prompt_ids + self.ids,
            max_new_tokens=min(self.request.max_new_tokens, left),
        )

    def completion(self) -> Completion:
        return Completion(list(self.ids), list(self.logprobs), mask=list(self.mask))


# Episodes from the environment's opening answer: (episode ids, first texts) -> episodes.
Begin = Callable[[list[int], list[str]], list[Episode]]


@dataclass
class EpisodeGroup:
    """One experiment's episodes of this step, in its prompts' order; none until its
    environment has started them (``begin``)."""

    session: EnvironmentSession
    prompts: list[tuple[str, str]]  # (prompt, answer) per episode, groupSize copies each
    begin: Begin
    observe: Observe
    max_turns: int
    episodes: list[Episode] = field(default_factory=list)
    opened: bool = False
    error: tuple[str, str] | None = None  # (what failed, FAILURE_REASONS kind)

    def live(self) -> list[Episode]:
        return [] if self.error else [e for e in self.episodes if not e.done]

    def fail(self, what: str, kind: str) -> None:
        if self.error is None:
            self.error = (what, kind)

    def start(self, ids: list[int], starts: list[str]) -> None:
        """The environment started the episodes: ``starts`` are their first texts."""
        self.opened = True
        self.episodes = self.begin(ids, starts)

    def take(self, e: Episode, c: Completion) -> None:
        """The policy's turn ``c`` for ``e``; a failed row fails the experiment."""
        if self.error:
            return
        if c.error is not None:
            self.fail(f"rollout failed: {c.error}", "rollout_error")
        elif c.nonfinite:
            self.fail("non-finite logits from the adapter (diverged)", "non_finite")
        else:
            e.take(c)

    def answer(self, steps: Sequence[Step]) -> None:
        """The environment's answers to the live episodes' latest turns, in order."""
        for e, s in zip(self.live(), steps, strict=True):
            e.reward += s.reward
            e.tool_calls += s.tool_calls
            room = e.budget - len(e.ids) - 1  # the policy keeps a token for its next turn
            if s.done:
                e.done = True
            elif e.turns >= self.max_turns or room <= 0:
                e.done = e.cut = True
            else:
                e.observe(self.observe(e.last_turn(), s, room)[:room])


def new_group(
    session: EnvironmentSession,
    prompts: Sequence[tuple[str, str]],
    encode_prompt: Callable[[str], list[int]],
    make_request: Callable[[list[int], int], RolloutRequest],
    budget: Callable[[list[int]], int],
    observe: Observe,
) -> EpisodeGroup:
    """One experiment's episodes of a step, one per (prompt, answer) (its groupSize
    copies included), to be started by its environment: then each first request is
    ``make_request(first text's ids, room)`` (room: the tokens it may add,
    ``budget(ids)``, at least 1), sampling at most ``room`` tokens."""

    def begin(ids: list[int], starts: list[str]) -> list[Episode]:
        encoded: dict[str, list[int]] = {}
        episodes = []
        for episode_id, text in zip(ids, starts, strict=True):
            prompt = encoded.get(text) or encoded.setdefault(text, encode_prompt(text))
            room = budget(prompt)
            episodes.append(Episode(episode_id, make_request(prompt, room), room))
        return episodes

    return EpisodeGroup(session, list(prompts), begin, observe, session.spec.max_turns)
