"""skyrl-gym's text environments (``BaseTextEnv``) behind our interface.

skyrl-gym environments take ``env_config`` and ``extras``: the task's answer goes in
as ``extras["reward_spec"]["ground_truth"]`` (what its GSM8K environments score against;
``extras["reward_model"]`` too, for its AIME one),
the engine's turn bound as ``extras["max_turns"]``, the spec's params as ``env_config``
and in ``extras`` too. Observations are chat messages: their contents are joined into
the text appended to the context. Tools run inside the environment's ``step`` (its tool
groups); a tool's output is the observation. Runs in the plug-in worker only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loraplex_engine.environments.base import Environment, Step


def is_skyrl_env(obj: object) -> bool:
    try:
        from skyrl_gym.envs.base_text_env import BaseTextEnv
    except ImportError:
        return False
    return isinstance(obj, type) and issubclass(obj, BaseTextEnv)


def _extras(answer: str, params: Mapping[str, str], max_turns: int) -> dict[str, Any]:
    return {
        **params,
        "reward_spec": {"method": "rule", "ground_truth": answer},
        "reward_model": {"ground_truth": answer},  # what its aime environment reads
        "extra_info": {"max_turns": max_turns},
        "max_turns": max_turns,
    }


def render(observations: Any) -> str:
    """Message contents (or a bare string) as the text appended to the context."""
    if isinstance(observations, str):
        return observations
    if not isinstance(observations, list):
        raise TypeError(
            f"observations must be a list of messages, got {type(observations).__name__}"
        )
    parts = []
    for message in observations:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, str):
            raise TypeError("an observation message has no string 'content'")
        parts.append(content)
    return "".join(f"\n{p}\n" for p in parts)


def messages(observations: Any) -> tuple[tuple[str, str], ...]:
    """The observation messages as (role, content), for chat-formatted observations."""
    if isinstance(observations, str):
        return (("user", observations),) if observations else ()
    render(observations)  # the same checks
    return tuple((str(m.get("role", "user")), m["content"]) for m in observations)


class SkyRLEnvironment(Environment):
    """A ``BaseTextEnv`` (a class, or an id registered with skyrl_gym) as an episode."""

    def __init__(
        self,
        env_id_or_class: str | type,
        prompt: str,
        answer: str,
        params: Mapping[str, str],
        max_turns: int,
    ) -> None:
        super().__init__(prompt, answer, params, max_turns)
        extras = _extras(answer, params, max_turns)
        if isinstance(env_id_or_class, str):
            import skyrl_gym

            self.env = skyrl_gym.make(env_id_or_class, env_config=dict(params), extras=extras)
        else:
            self.env = env_id_or_class(env_config=dict(params), extras=extras)

    def start(self) -> str:
        messages, _meta = self.env.init([{"role": "user", "content": self.prompt}])
        if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
            return "".join(str(m.get("content", "")) for m in messages)
        return self.prompt

    def step(self, action: str) -> Step:
        out = self.env.step(action)
        if not isinstance(out, dict):
            raise TypeError(f"step returned a {type(out).__name__}, not a dict")
        metadata = out.get("metadata") or {}
        calls = metadata.get("tool_calls", 0) if isinstance(metadata, dict) else 0
        observations = out.get("observations") or []
        return Step(
            observation=render(observations),
            messages=messages(observations),
            reward=out.get("reward", 0.0),  # checked by the engine (a number, finite)
            done=bool(out.get("done")),
            tool_calls=calls if isinstance(calls, int) else 0,
        )

    def close(self) -> None:
        self.env.close()
