"""``POST /v1/completions``: the OpenAI completions subset, served from the rollout queue.

Each prompt becomes one blocking ``engine.complete`` call in a worker thread; the engine
answers it in its next rollout batch, so a request waits at most one tick. The threads
come from a limiter of their own, so waiting completions cannot starve the other routes
of FastAPI's thread pool.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

import anyio
from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from loraplex_engine.api_types import EngineService
from loraplex_engine.server_errors import documented_errors

MAX_PROMPTS = 16
MAX_N = 16
MAX_CHOICES = 64
MAX_PROMPT_CHARS = 8_192
DEFAULT_MAX_COMPLETION_TOKENS = 512
COMPLETION_THREADS = 32


class CompletionRequestBase(BaseModel):
    # No unknown fields, no coercion (true is not 1, "8" is not 8), as in the spec.
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1, max_length=253, description="experiment id or base model")
    prompt: (
        Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
        | Annotated[
            list[Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]],
            Field(min_length=1, max_length=MAX_PROMPTS),
        ]
    )
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    n: int = Field(1, ge=1, le=MAX_N)

    @model_validator(mode="after")
    def _bounded(self) -> CompletionRequestBase:
        prompts = 1 if isinstance(self.prompt, str) else len(self.prompt)
        if prompts * self.n > MAX_CHOICES:
            raise PydanticCustomError(
                "too_many_choices",
                "{prompts} prompt(s) x n={n} choices; at most {limit} in one request",
                {"prompts": prompts, "n": self.n, "limit": MAX_CHOICES, "field": "n"},
            )
        return self


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


def default_counter(engine: EngineService) -> Callable[[str], int]:
    """Counts with the engine's tokenizer when it has one (looked up per call: the engine
    may still be loading when the app is built), else whitespace-separated words."""

    def count(text: str) -> int:
        tokenizer = getattr(engine, "tokenizer", None)
        if tokenizer is not None and callable(getattr(tokenizer, "encode", None)):
            return len(tokenizer.encode(text, add_special_tokens=False))
        return len(text.split())

    return count


def add_completions_route(
    app: FastAPI,
    ready_engine: Callable[[], EngineService],
    *,
    wake: Callable[[], None],
    count_tokens: Callable[[str], int],
    max_completion_tokens: int,
    route_options: dict[str, Any],
) -> None:
    """Adds the route; ``ready_engine`` answers the engine or raises 503 while it loads."""
    limiter = anyio.CapacityLimiter(COMPLETION_THREADS)

    class CompletionRequest(CompletionRequestBase):
        # The engine's own limit, so the schema states it.
        max_tokens: int = Field(min(16, max_completion_tokens), ge=1, le=max_completion_tokens)

    async def completions(body: CompletionRequestBase) -> dict[str, Any]:
        """OpenAI completions subset. `model` is an experiment id (its current adapter)
        or the base model's name; served in the engine's next rollout batch."""
        engine = await run_in_threadpool(ready_engine)
        prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)

        async def one(prompt: str) -> list[str]:
            return await anyio.to_thread.run_sync(
                engine.complete,
                body.model,
                prompt,
                body.max_tokens,
                body.temperature,
                body.n,
                limiter=limiter,
            )

        tasks = [asyncio.ensure_future(one(p)) for p in prompts]
        wake()
        try:
            results = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        return _response(body, prompts, results, count_tokens)

    # The body type is local to this app (its max_tokens limit); annotations here are
    # strings that FastAPI would resolve in the module, so set the real class.
    completions.__annotations__["body"] = CompletionRequest
    app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses=documented_errors(400, 401, 404, 422, 503),
        **route_options,
    )(completions)


def _response(
    body: CompletionRequestBase,
    prompts: list[str],
    results: list[list[str]],
    count_tokens: Callable[[str], int],
) -> dict[str, Any]:
    choices = []
    completion_tokens = 0
    for texts in results:
        for text in texts:
            used = count_tokens(text)
            completion_tokens += used
            reason = "length" if used >= body.max_tokens else "stop"
            choices.append({"index": len(choices), "text": text, "finish_reason": reason})
    prompt_tokens = sum(count_tokens(p) for p in prompts)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
