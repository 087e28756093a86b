"""An environment's observation as the token ids appended to its episode's context.

``text``: the observation's text encoded as it is (for base models). ``chat``: its
messages (user or tool) through the tokenizer's chat template, for chat models: the ids
are the *delta* the template writes after an assistant turn when the messages are added
with the assistant turn opened again, rendered on a fixed stand-in conversation. The
ids of the policy's turns are never touched or re-tokenised: an observation only adds
ids after them (the assistant turn's closing text first, where the sampled turn did not
end with it already).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from loraplex_engine.environments.base import Step
from loraplex_engine.spec.errors import InvalidSpecError
from loraplex_engine.tokens import ChatTemplates, TokenCodec

if TYPE_CHECKING:  # episodes.py imports torch; `run` checks templates before it loads
    from loraplex_engine.environments.episodes import Observe
    from loraplex_engine.spec.experiment import TaskSpec

# Characters of an observation encoded at most per token of room (a token is at least a
# byte of text, so this keeps every token that can fit and bounds the encoder's work).
CHARS_PER_TOKEN = 16
# The stand-in conversation the deltas are rendered on: what an assistant turn is
# followed by does not depend on what the turn said.
_TURN = "loraplex-assistant-turn"
_BASE = [{"role": "user", "content": "question"}, {"role": "assistant", "content": _TURN}]
FIELD = "spec.task.environment.observationFormat"
# The roles an observation's message may take (never the assistant's: those are sampled).
OBSERVATION_ROLES = ("user", "tool")


def text_observer(encode: Callable[[str], list[int]]) -> Observe:
    """The observation's text, encoded (empty: no ids)."""

    def observe(_turn: list[int], step: Step, room: int) -> list[int]:
        text = step.observation[: (room + 1) * CHARS_PER_TOKEN]
        return encode(text) if text else []

    return observe


class ChatObserver:
    """Observations as chat messages through ``tokenizer``'s template. ``ValueError``
    when the template cannot be used so (it drops the assistant's message, or re-renders
    the earlier turns when a message is added)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.before = tokenizer.apply_chat_template(_BASE, tokenize=False)
        if _TURN not in self.before:
            raise ValueError("the chat template does not render an assistant's message")
        close = self.before[self.before.rindex(_TURN) + len(_TURN) :]
        self.close_ids = self._encode(close)  # the assistant turn's end, e.g. <|im_end|>\n
        self.delta([("user", "observation")])  # the template adds messages at the end

    def _encode(self, text: str) -> list[int]:
        # The template writes its own special tokens: add none.
        return self.tokenizer(text, add_special_tokens=False).input_ids if text else []

    def delta(self, messages: tuple[tuple[str, str], ...] | list[tuple[str, str]]) -> str:
        """The text the template adds after an assistant turn for ``messages``, ending
        with the assistant turn opened again."""
        added = [{"role": r, "content": c} for r, c in messages]
        after = self.tokenizer.apply_chat_template(
            _BASE + added, tokenize=False, add_generation_prompt=True
        )
        if not after.startswith(self.before):
            raise ValueError("the chat template renders earlier turns anew when one is added")
        return after[len(self.before) :]

    def __call__(self, turn: list[int], step: Step, room: int) -> list[int]:
        left = (room + 1) * CHARS_PER_TOKEN  # bounds the encoder's work, as text's
        messages = []
        for role, content in step.chat():
            if role not in OBSERVATION_ROLES:
                raise ValueError(
                    f"an observation has a {role!r} message; observations may be "
                    f"{' or '.join(OBSERVATION_ROLES)} messages"
                )
            messages.append((role, content[:left]))
            left = max(0, left - len(content))
        if not messages:
            return []
        return self.close_ids[_closed(turn, self.close_ids) :] + self._encode(self.delta(messages))


def _closed(turn: list[int], close: list[int]) -> int:
    """How much of the closing ``close`` the sampled ``turn`` ends with (its stop token)."""
    for k in range(min(len(close), len(turn)), 0, -1):
        if turn[-k:] == close[:k]:
            return k
    return 0


def observation_format(task: TaskSpec) -> str:
    env = task.environment
    if env is not None and env.observation_format is not None:
        return env.observation_format
    return "chat" if task.chat_template else "text"


def observer(task: TaskSpec, codec: TokenCodec) -> Observe:
    """How ``task``'s environment's observations are encoded (checked at PUT)."""
    if observation_format(task) == "chat":
        return ChatObserver(codec.tokenizer)
    return text_observer(codec.encode)


def check_chat_templates(task: TaskSpec, codec: ChatTemplates, model: str) -> None:
    """At PUT: the prompt's and the observations' chat rendering, where the spec asks
    for them, work with this engine's tokenizer (an ``InvalidSpecError`` naming the
    field otherwise)."""
    if task.chat_template and not codec.has_chat_template:
        raise InvalidSpecError(
            f"the tokenizer of {model} has no chat template", field="spec.task.chatTemplate"
        )
    if task.environment is None or observation_format(task) != "chat":
        return
    if not codec.has_chat_template:
        raise InvalidSpecError(
            f"the tokenizer of {model} has no chat template: use observationFormat text",
            field=FIELD,
        )
    try:
        ChatObserver(codec.tokenizer)
    except Exception as e:  # a template that cannot be used so: say why
        raise InvalidSpecError(
            f"the chat template of {model} cannot add observations: {e}; use "
            "observationFormat text",
            field=FIELD,
        ) from e
