"""One experiment's environment, seen from the engine: its episodes live in the
experiment's plug-in worker (environments/worker.py); every call is one bounded round trip for
a batch of episodes, and every answer is checked here (a wrong count, a non-string
observation, a non-finite reward: a ``PluginError``, its experiment fails)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from loraplex_engine.environments.base import Step
from loraplex_engine.plugins.host import PluginHost
from loraplex_engine.spec.echo import clip
from loraplex_engine.spec.errors import PluginError, TaskError
from loraplex_engine.spec.plugins import EnvironmentSpec
from loraplex_engine.tasks.rewards import check_score


class EnvironmentSession:
    def __init__(self, spec: EnvironmentSpec, host: PluginHost) -> None:
        self.spec, self.host = spec, host
        self.what = f"environment {spec.name}"
        self._ids = itertools.count()
        self._ended: list[int] = []  # episodes to close, sent with the next open
        self.closed = False

    def check(self) -> None:
        """The environment's verdict on the spec's params (at PUT): a ``TaskError``
        naming the param it refuses (``spec.task.environment.params[.NAME]``)."""
        request = {
            "op": "env_check",
            "name": self.spec.name,
            "params": dict(self.spec.params),
            "maxTurns": self.spec.max_turns,
        }
        problem = self.host.call(self.what, request).get("problem")
        if problem is None:
            return
        if not isinstance(problem, dict):
            raise PluginError(f"{self.what}: its params check answered {type(problem).__name__}")
        param, message = problem.get("param"), problem.get("message")
        if problem.get("load"):
            raise TaskError(
                "spec.task.environment.name", f"{self.what} cannot be loaded here: {message}"
            )
        field = "spec.task.environment.params"
        if isinstance(param, str) and param in self.spec.params:
            field += f".{param}"
        elif isinstance(param, str):  # one it lacks: named in the message
            message = f"{clip(param)}: {message}"
        raise TaskError(field, f"{self.what} refused its params: {message}")

    def open(self, prompts: Sequence[tuple[str, str]]) -> tuple[list[int], list[str]]:
        """Start one episode per (prompt, answer); their ids and first texts. The worker
        first closes the episodes that ended since the last open (no call of their own)."""
        ids = [next(self._ids) for _ in prompts]
        ended, self._ended = self._ended, []
        request = {
            "op": "env_open",
            "close": ended,
            "name": self.spec.name,
            "params": dict(self.spec.params),
            "maxTurns": self.spec.max_turns,
            "episodes": [
                {"id": i, "prompt": p, "answer": a} for i, (p, a) in zip(ids, prompts, strict=True)
            ],
        }
        starts = self.host.call(self.what, request).get("starts")
        if not isinstance(starts, list) or len(starts) != len(ids):
            raise PluginError(f"{self.what}: started {_count(starts)} of {len(ids)} episodes")
        if not all(isinstance(s, str) for s in starts):
            raise PluginError(f"{self.what}: an episode's start is not text")
        return ids, starts

    def step(self, actions: Sequence[tuple[int, str]]) -> list[Step]:
        """Each episode's answer to the policy's turn (episode id, decoded text)."""
        if not actions:
            return []
        steps = self.host.call(self.what, {"op": "env_step", "steps": list(actions)}).get("steps")
        if not isinstance(steps, list) or len(steps) != len(actions):
            raise PluginError(f"{self.what}: {_count(steps)} answers for {len(actions)} turns")
        return [self._step(s, i) for i, s in enumerate(steps)]

    def _step(self, raw: object, index: int) -> Step:
        if not isinstance(raw, list) or len(raw) != 5 or not isinstance(raw[0], str):
            raise PluginError(f"{self.what}: answer {index} is malformed")
        observation, reward, done, calls, chat = raw
        reward = check_score(reward, index, self.what)  # a number, finite
        calls = calls if isinstance(calls, int) else 0
        return Step(observation, reward, bool(done), calls, messages=self._chat(chat, index))

    def _chat(self, chat: object, index: int) -> tuple[tuple[str, str], ...]:
        """The observation's chat messages, (role, text) pairs (their roles are checked
        where they are rendered: observations.py)."""
        ok = isinstance(chat, list) and all(
            isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) for x in m) for m in chat
        )
        if not ok:
            raise PluginError(f"{self.what}: answer {index}'s messages are malformed")
        assert isinstance(chat, list)
        return tuple((m[0], m[1]) for m in chat)

    def close_episodes(self, ids: Sequence[int]) -> None:
        """Episodes that ended: closed by the worker at the next open (or with it)."""
        self._ended += ids

    def close(self) -> None:
        self.closed = True
        self.host.close()


def _count(value: object) -> int | str:
    return len(value) if isinstance(value, list) else "no list"
