"""The spec's plug-in fields: ``task.reward`` (a built-in or an installed reward plug-in)
and ``task.environment`` (an installed environment). Which plug-ins exist is the engine
image's business, not the CRD's: the schema bounds the names' form and the engine
refuses an unknown one at PUT, listing what it has installed (plugins/discovery.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from loraplex_engine.spec.params import EnvironmentParams
from loraplex_engine.spec.schema import Int32, SpecModel

# The built-ins; kept equal to tasks.REWARD_NAMES (tested). "default" = the task's own.
BUILTIN_REWARDS = (
    "default", "exact-match", "contains", "prefix-overlap", "word-fraction", "coverage", "http"
)  # fmt: skip
# An entry point's name, a skyrl-gym id or verifiers:<module>: letters, digits and . _ - : /
PluginName = Annotated[
    str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
]
ObservationFormat = Literal["chat", "text"]
MAX_TURNS = 64
MAX_EPISODE_TOKENS = 32768


class EnvironmentSpec(SpecModel):
    """A multi-turn environment: the policy acts in turns, the environment answers each
    (a tool's output, feedback) and scores the episode. Prompts still come from the task."""

    name: PluginName = Field(
        description="An installed environment: an entry point of the group "
        "loraplex.environments, an installed skyrl-gym environment id (gsm8k, "
        "gsm8k_multi_turn, ...), or verifiers:<module> for an installed verifiers "
        "environment. The engine refuses a name it does not have, listing those "
        "it has (GET /v1/capacity lists them too).",
    )
    params: EnvironmentParams = Field(
        default_factory=dict,
        description="The environment's settings, as strings, passed to it as they are: at "
        "most 64, names of 1 to 128 characters, values of at most 4096, 64 KiB as JSON in "
        "all.",
    )
    max_turns: Int32 = Field(
        4,
        alias="maxTurns",
        ge=1,
        le=MAX_TURNS,
        description="Most policy turns an episode takes; an episode still going is cut "
        "there, scored by the rewards of its turns so far.",
    )
    max_episode_tokens: Int32 = Field(
        512,
        alias="maxEpisodeTokens",
        ge=1,
        le=MAX_EPISODE_TOKENS,
        description="Most tokens an episode adds after its prompt, the policy's and the "
        "environment's together (each turn samples at most rollout.maxNewTokens); an "
        "episode that reaches it ends there.",
    )
    observation_format: ObservationFormat | None = Field(
        None,
        alias="observationFormat",
        description="How the environment's observations join an episode's context: chat "
        "(as user or tool messages through the base model's chat template, the assistant "
        "turn opened again after them) or text (appended as they are, for base models). "
        "Absent: chat when task.chatTemplate is set, else text. chat needs a tokenizer "
        "with a chat template (the engine refuses the spec otherwise).",
    )
