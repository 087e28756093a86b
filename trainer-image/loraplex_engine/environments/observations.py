"""An environment's observation as the token ids appended to its episode's context.

``text``: the observation's text encoded as it is (for base models). The ids of the
policy's turns are never touched: an observation only adds ids after them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loraplex_engine.environments.base import Step
from loraplex_engine.environments.episodes import Observe
from loraplex_engine.tokens import TokenCodec

# Characters of an observation encoded at most per token of room (a token is at least a
# byte of text, so this keeps every token that can fit and bounds the encoder's work).
CHARS_PER_TOKEN = 16


def text_observer(encode: Callable[[str], list[int]]) -> Observe:
    """The observation's text, encoded (empty: no ids)."""

    def observe(_turn: list[int], step: Step, room: int) -> list[int]:
        text = step.observation[: (room + 1) * CHARS_PER_TOKEN]
        return encode(text) if text else []

    return observe


def observer(task: Any, codec: TokenCodec) -> Observe:
    """How ``task``'s environment's observations are encoded (its spec.task)."""
    return text_observer(codec.encode)
