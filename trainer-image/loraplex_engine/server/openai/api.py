"""The OpenAI request bodies the engine serves: ``/v1/completions`` and
``/v1/chat/completions``.

Unknown fields are refused (a typo is an error, never a silent default). OpenAI's
parameters that the engine does not implement are accepted at their neutral value only
(``best_of`` = ``n``, zero penalties, empty ``logit_bias``, no tools): any other value
would change the result, so it is a 400 naming the parameter, not ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator
from pydantic_core import PydanticCustomError

MAX_PROMPTS = 16
MAX_N = 16
MAX_CHOICES = 64
MAX_PROMPT_CHARS = 8_192
MAX_PROMPT_TOKENS = 8_192
MAX_STOPS = 4  # as OpenAI
MAX_TOP_LOGPROBS = 5  # alternatives per token, OpenAI's bound for completions
MAX_MESSAGES = 256

PromptText = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_PROMPT_TOKENS)]
StopText = Annotated[str, Field(min_length=1, max_length=256)]


def _refuse(field: str, message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", message, {"field": field})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What both routes share: the model, the sampling, streaming, neutral extras."""

    # No unknown fields, no coercion (true is not 1, "8" is not 8), as in the spec.
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1, max_length=253, description="experiment id or base model")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOPS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    user: str | None = Field(None, max_length=256, description="accepted, not used")
    presence_penalty: float | None = Field(None, description="0 only")
    frequency_penalty: float | None = Field(None, description="0 only")
    logit_bias: dict[str, float] | None = Field(None, description="empty only")

    @model_validator(mode="after")
    def _neutral_extras(self) -> SamplingRequest:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise _refuse(name, "only 0 is supported: the engine samples without penalties")
        if self.logit_bias:
            raise _refuse("logit_bias", "not supported: only an empty logit_bias is accepted")
        if self.stream_options is not None and not self.stream:
            raise _refuse("stream_options", "only allowed with stream: true")
        return self

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequestBase(SamplingRequest):
    prompt: (
        PromptText
        | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, description="equal to n only")
    suffix: str | None = Field(None, description="empty only")

    @model_validator(mode="after")
    def _bounded(self) -> CompletionRequestBase:
        if self.best_of is not None and self.best_of != self.n:
            raise _refuse("best_of", "only best_of equal to n is supported (no ranking)")
        if self.suffix:
            raise _refuse("suffix", "not supported: the engine does not insert text")
        if self.echo and self.logprobs is not None:
            raise _refuse("echo", "echo with logprobs (prompt log-probs) is not supported")
        prompts = len(self.prompts)
        if prompts * self.n > MAX_CHOICES:
            raise PydanticCustomError(
                "too_many_choices",
                "{prompts} prompt(s) x n={n} choices; at most {limit} in one request",
                {"prompts": prompts, "n": self.n, "limit": MAX_CHOICES, "field": "n"},
            )
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a text or its token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p) if p else [[]]  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: (
        Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
        | Annotated[list[TextPart], Field(max_length=64)]
    )
    name: str | None = Field(None, max_length=64)

    def for_template(self) -> dict[str, str]:
        """Parts joined into one text; ``developer`` is OpenAI's newer name for system."""
        text = (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": text} | ({"name": self.name} if self.name else {})


class ChatRequestBase(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = Field(None, description="empty only")
    tool_choice: Literal["none"] | None = None
    response_format: dict[str, Any] | None = Field(None, description='{"type": "text"} only')

    @model_validator(mode="after")
    def _neutral_chat(self) -> ChatRequestBase:
        if self.tools:
            raise _refuse("tools", "tool calls are not supported")
        if self.response_format not in (None, {"type": "text"}):
            raise _refuse("response_format", 'only {"type": "text"} is supported')
        if self.top_logprobs and not self.logprobs:
            raise _refuse("top_logprobs", "needs logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise _refuse("max_completion_tokens", "give max_tokens or max_completion_tokens")
        return self

    @property
    def alternatives(self) -> int | None:
        """Alternatives per token: None without logprobs, else 0..MAX_TOP_LOGPROBS."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


def with_token_limit(base: type[SamplingRequest], limit: int, default: int | None) -> type:
    """The body class of one app: its ``max_tokens`` bound, so the schema states it."""
    fields: dict[str, Any] = {
        "max_tokens": (int | None, Field(default, ge=1, le=limit)),
    }
    if base is ChatRequestBase:
        fields["max_completion_tokens"] = (int | None, Field(None, ge=1, le=limit))
    name = base.__name__.removesuffix("Base")
    return create_model(name, __base__=base, **fields)  # type: ignore[call-overload]
