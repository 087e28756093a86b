"""A multi-turn step as the tick plans it: its episodes' group (not started yet: the
player starts it, environments/player.py), their token room and the step's cost."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from loraplex_engine.environments.episodes import EpisodeGroup, new_group
from loraplex_engine.environments.observations import observer
from loraplex_engine.rollout.base import RolloutRequest
from loraplex_engine.spec.api_types import MAX_NEW_TOKENS
from loraplex_engine.spec.plugins import EnvironmentSpec
from loraplex_engine.tasks import Prompt
from loraplex_engine.tokens import TokenCodec

if TYPE_CHECKING:
    from loraplex_engine.environments.session import EnvironmentSession
    from loraplex_engine.spec.experiment import TaskSpec


def room(env: EnvironmentSpec, prompt: list[int], limits: tuple[int, int | None]) -> int:
    """Tokens an episode may add after ``prompt``: its spec's bound, within the longest
    row the engine admits (the prompt limit plus the largest maxNewTokens: the vLLM
    sampler's max_model_len) and the context. ``limits``: (max prompt tokens, context)."""
    max_prompt_tokens, context_tokens = limits
    left = min(env.max_episode_tokens, max_prompt_tokens + MAX_NEW_TOKENS - len(prompt))
    if context_tokens is not None:
        left = min(left, context_tokens - len(prompt))
    return max(1, left)


def plan_group(
    task: TaskSpec,
    session: EnvironmentSession,
    prompts: Sequence[Prompt],
    group_size: int,
    encode: Callable[[Prompt], list[int]],
    request: Callable[[list[int], int], RolloutRequest],
    codec: TokenCodec,
    limits: tuple[int, int | None],
) -> tuple[EpisodeGroup, int]:
    """The step's group (``groupSize`` episodes a prompt) and its cost in tokens,
    estimated with the prompts as the first texts (encoded now: a prompt over the limit
    fails the step here, as a single-turn one's does)."""
    env = task.environment
    assert env is not None
    pairs = [(p.text, p.answer) for p in prompts for _ in range(group_size)]

    def encode_text(text: str) -> list[int]:
        return encode(Prompt(text, ""))

    def bound(ids: list[int]) -> int:
        return room(env, ids, limits)

    group = new_group(session, pairs, encode_text, request, bound, observer(task, codec))
    cost = group_size * sum(len(ids) + bound(ids) for ids in map(encode, prompts))
    return group, cost
