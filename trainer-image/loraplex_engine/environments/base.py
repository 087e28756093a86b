"""The environment interface of our own: one object per episode, text in and out.

A plug-in environment subclasses :class:`Environment` (or is a skyrl-gym ``BaseTextEnv``,
adapted by skyrl.py) and is installed under the entry-point group
``loraplex.environments``. It runs in the experiment's plug-in worker, never in the
engine's process; every call is bounded in wall-clock time by the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

from loraplex_engine.spec.errors import ParamError

__all__ = ["Environment", "ParamError", "Step"]


@dataclass(frozen=True)
class Step:
    """The environment's answer to one policy turn."""

    observation: str = ""  # appended to the context (masked out of the loss); "" = none
    reward: float = 0.0  # this turn's reward; the episode's is the sum over its turns
    done: bool = False  # the episode ended (else the policy takes another turn)
    tool_calls: int = 0  # tools the environment ran for this turn (reported, not trained)
    # With task.environment.observationFormat chat: the observation's message role (user
    # or tool), or several (role, content) messages (skyrl-gym's) instead of one.
    role: str = "user"
    messages: tuple[tuple[str, str], ...] = ()

    def chat(self) -> tuple[tuple[str, str], ...]:
        """The observation as chat messages (none for an empty observation)."""
        if self.messages:
            return self.messages
        return ((self.role, self.observation),) if self.observation else ()


class Environment(ABC):
    """One episode. ``prompt`` and ``answer`` come from the experiment's task (its
    generated problem or dataset row), ``params`` from ``spec.task.environment.params``
    (strings, as the tenant wrote them: check them), ``max_turns`` is the engine's bound."""

    def __init__(self, prompt: str, answer: str, params: Mapping[str, str], max_turns: int) -> None:
        self.prompt, self.answer, self.params, self.max_turns = prompt, answer, params, max_turns

    @classmethod
    def check_params(cls, params: Mapping[str, str]) -> None:
        """Refuse bad ``params`` at PUT, before any episode: raise :class:`ParamError`
        (or ``ValueError``) saying what is wrong. Default: every params accepted."""
        return None

    def start(self) -> str:
        """The text the policy sees first (default: the task's prompt)."""
        return self.prompt

    @abstractmethod
    def step(self, action: str) -> Step:
        """The environment's answer to the policy's turn ``action`` (its decoded text)."""

    def close(self) -> None:
        """Release what the episode holds (default: nothing)."""
        return None
