"""Many experiments' multi-turn episodes, played turn by turn inside one tick.

The first turn rides in the tick's rollout batch with every other experiment's rows
(tick.py); from then on each turn is one generate call for every episode still going, of
every experiment, from the experiment's live adapter: the fused design, turn by turn.
Between turns each experiment's environment answers its episodes' turns in one bounded
call, the experiments' calls concurrently (an environment's latency is its own).

An episode's row is its prompt, then the policy's sampled token ids with their
log-probs, exactly as sampled (never re-tokenised), interleaved with the environment's
observations, encoded and masked out of the loss (``Completion.mask`` 0). Bounds: the
spec's ``maxTurns`` (an episode still going is cut there, scored by its turns so far:
an environment that never ends costs its experiment that, nothing else) and its
``maxEpisodeTokens`` (each turn samples at most what is left; an observation is cut to
leave the policy a token).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from loraplex_engine.environments.session import EnvironmentSession
from loraplex_engine.rollout.base import Completion, RolloutRequest

Generate = Callable[[list[RolloutRequest]], list[Completion]]
# Characters of an observation encoded at most per token of room (a token is at least a
# byte of text, so this keeps every token that can fit and bounds the encoder's work).
CHARS_PER_TOKEN = 16


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

    def next_request(self) -> RolloutRequest:
        left = self.budget - len(self.ids)
        return dataclasses.replace(
            self.request,
            prompt_ids=self.request.prompt_ids + self.ids,
            max_new_tokens=min(self.request.max_new_tokens, left),
        )

    def completion(self) -> Completion:
        return Completion(list(self.ids), list(self.logprobs), mask=list(self.mask))


@dataclass
class EpisodeGroup:
    """One experiment's episodes of this step, in its requests' order."""

    session: EnvironmentSession
    episodes: list[Episode]
    max_turns: int
    error: tuple[str, str] | None = None  # (what failed, FAILURE_REASONS kind)

    def live(self) -> list[Episode]:
        return [] if self.error else [e for e in self.episodes if not e.done]


def play(
    groups: Sequence[EpisodeGroup],
    firsts: Sequence[Sequence[Completion]],
    generate: Generate,
    decode: Callable[[list[int]], str],
    encode: Callable[[str], list[int]],
) -> None:
    """Play every group's episodes to their end from their sampled first turns; each
    group ends with its episodes done, or with ``error`` set (that experiment fails)."""
    for g, outs in zip(groups, firsts, strict=True):
        for e, c in zip(g.episodes, outs, strict=True):
            _take(g, e, c)
    with ThreadPoolExecutor(max_workers=max(1, len(groups)), thread_name_prefix="env") as pool:
        while True:
            live = [g for g in groups if g.live()]
            actions = [[(e.id, decode(e.ids[e.turn_start :])) for e in g.live()] for g in live]
            answers = list(pool.map(_step, live, actions))
            for g, steps in zip(live, answers, strict=True):
                _answer(g, steps, encode)
            going = [(g, e) for g in groups for e in g.live()]
            if not going:
                break
            outs = generate([e.next_request() for _, e in going])
            for (g, e), c in zip(going, outs, strict=True):
                _take(g, e, c)
        list(pool.map(_close, groups))


def _take(g: EpisodeGroup, e: Episode, c: Completion) -> None:
    if g.error:
        return
    if c.error is not None:
        g.error = (f"rollout failed: {c.error}", "rollout_error")
    elif c.nonfinite:
        g.error = ("non-finite logits from the adapter (diverged)", "non_finite")
    else:
        e.take(c)


def _step(g: EpisodeGroup, actions: list[tuple[int, str]]) -> list | Exception:
    try:
        return g.session.step(actions)
    except Exception as e:  # the environment's failure is its experiment's
        return e


def _answer(g: EpisodeGroup, steps: list | Exception, encode: Callable[[str], list[int]]) -> None:
    if isinstance(steps, Exception):
        g.error = (f"environment failed: {' '.join(str(steps).split())[:500]}", "reward_error")
        return
    for e, s in zip(g.live(), steps, strict=True):
        e.reward += s.reward
        e.tool_calls += s.tool_calls
        room = e.budget - len(e.ids) - 1  # the policy keeps a token for its next turn
        if s.done:
            e.done = True
        elif e.turns >= g.max_turns or room <= 0:
            e.done = e.cut = True
        else:
            obs = (
                encode(s.observation[: (room + 1) * CHARS_PER_TOKEN])[:room]
                if s.observation
                else []
            )
            e.observe(obs)


def _close(g: EpisodeGroup) -> None:
    try:
        g.session.close_episodes([e.id for e in g.episodes])
    except Exception as e:  # a worker that hangs on close is stopped: the next step fails
        if g.error is None:
            g.error = (f"environment failed: {' '.join(str(e).split())[:500]}", "reward_error")


def open_group(
    session: EnvironmentSession,
    prompts: Sequence[tuple[str, str]],
    encode_prompt: Callable[[str], list[int]],
    make_request: Callable[[list[int], int], RolloutRequest],
    budget: Callable[[list[int]], int],
) -> EpisodeGroup:
    """One experiment's episodes of a step, one per (prompt, answer) (its groupSize
    copies included): started in its environment, their first requests made by
    ``make_request(prompt ids, room)`` (room: the tokens it may add, ``budget(prompt ids)``,
    at least 1), sampling at most ``room`` tokens."""
    ids, starts = session.open(prompts)
    encoded: dict[str, list[int]] = {}
    episodes = []
    for episode_id, text in zip(ids, starts, strict=True):
        prompt = encoded.get(text) or encoded.setdefault(text, encode_prompt(text))
        room = budget(prompt)
        request = make_request(prompt, room)
        episodes.append(Episode(episode_id, request, room))
    return EpisodeGroup(session, episodes, session.spec.max_turns)
