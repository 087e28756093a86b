"""The episode driver's tests without a model: ids of one character each (`as_ids`,
`as_text`), a scripted policy that says which call and row each log-prob came from, a
group of episodes opened on a real environment session, and the sessions themselves,
opened in a real plug-in worker and closed after the test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from loraplex_engine.environments.episodes import EpisodeGroup, new_group
from loraplex_engine.environments.observations import text_observer
from loraplex_engine.environments.player import play
from loraplex_engine.environments.session import EnvironmentSession
from loraplex_engine.plugins.host import PluginHost
from loraplex_engine.rollout.base import Completion, RolloutRequest
from loraplex_engine.spec.plugins import EnvironmentSpec

from tests.support.plugin_install import with_path


def as_text(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def as_ids(text: str) -> list[int]:
    return [ord(c) for c in text]


class ScriptedPolicy:
    """Answers each request with ``turn`` (ids of one character each) and log-probs that
    say which call and row they came from; records the requests."""

    def __init__(self, turn: str) -> None:
        self.turn, self.calls = turn, []

    def __call__(self, requests: list[RolloutRequest]) -> list[Completion]:
        self.calls.append(requests)
        k = len(self.calls)
        out = []
        for r, req in enumerate(requests):
            ids = as_ids(self.turn)[: req.max_new_tokens]
            out.append(Completion(ids, [-(k + r / 100)] * len(ids), finish_reason="stop"))
        return out


def episode_group(
    session: EnvironmentSession,
    prompts: list[tuple[str, str]],
    budget: int,
    new: int = 8,
    slot: int = 1,
    opened: bool = True,
):
    def request(ids: list[int], room: int) -> RolloutRequest:
        return RolloutRequest(slot, prompt_ids=ids, max_new_tokens=min(new, room), temperature=1)

    group = new_group(session, prompts, as_ids, request, lambda ids: budget, text_observer(as_ids))
    if opened:  # started here, at once (its environment's errors raise): as the worker
        group.start(*session.open(prompts))  # answers the tick's first call of a step
    return group


def play_group(group: EpisodeGroup, policy: ScriptedPolicy) -> None:
    play([group], policy, as_text)


def opened_sessions(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., EnvironmentSession]]:
    """For a fixture to `yield from`: opens environment sessions whose plug-in workers
    find the packages installed at ``site``; closes every one after the test."""
    monkeypatch.setenv("PYTHONPATH", with_path(site)["PYTHONPATH"])
    opened: list[EnvironmentSession] = []

    def make(name: str, max_turns: int, max_tokens: int = 512, timeout: float = 30.0, params=None):
        spec = EnvironmentSpec(
            name=name, maxTurns=max_turns, maxEpisodeTokens=max_tokens, params=params or {}
        )
        host = PluginHost("test", f"environment:{name}", timeout)
        opened.append(EnvironmentSession(spec, host))
        return opened[-1]

    yield make
    for s in opened:
        s.close()
