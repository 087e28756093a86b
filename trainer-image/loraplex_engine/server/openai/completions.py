"""``POST /v1/completions``: OpenAI's completions, served from the rollout queue.

The request body is ``api.CompletionRequestBase``; the choices come from
``choices.py`` (one engine job per prompt, tokens as the decode makes them). With
``stream: true`` the answer is server-sent events in OpenAI's ``text_completion`` chunk
format, ending with ``data: [DONE]``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from loraplex_engine.server.errors import streamed_or_json
from loraplex_engine.server.observe import ServingCall, serving_call
from loraplex_engine.server.openai.api import CompletionRequestBase, with_token_limit
from loraplex_engine.server.openai.choices import (
    COMPLETION_THREADS,
    ChoiceRequest,
    ChoiceRun,
    ChoiceText,
    sse,
    stream_error,
    usage,
)
from loraplex_engine.spec.errors import NotFoundError
from loraplex_engine.spec.service import EngineService


class CompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, int]


def add_completions_route(
    app: FastAPI,
    ready_engine: Callable[[], EngineService],
    *,
    wake: Callable[[], None],
    max_completion_tokens: int,
    route_options: dict[str, Any],
) -> None:
    """Adds the route; ``ready_engine`` answers the engine or raises 503 while it loads."""
    limiter = anyio.CapacityLimiter(COMPLETION_THREADS)
    body_type = with_token_limit(
        CompletionRequestBase, max_completion_tokens, min(16, max_completion_tokens)
    )

    async def completions(body: CompletionRequestBase, request: Request) -> Any:
        """OpenAI completions. `model` is an experiment id (its current adapter) or the
        base model's name; served in the engine's next rollout batch."""
        call = serving_call(request)
        call.model = body.model
        engine = await run_in_threadpool(ready_engine)
        await run_in_threadpool(check_model, engine, body.model)
        prompts = [await run_in_threadpool(engine.tokenize, p) for p in body.prompts]
        texts = [p if isinstance(p, str) else engine.detokenize(p) for p in body.prompts]
        choices = [
            ChoiceText(engine.detokenize, body.stops, texts[i // body.n] if body.echo else "")
            for i in range(len(prompts) * body.n)
        ]
        job = ChoiceRequest(
            body.model,
            prompts,
            body.max_tokens or 16,
            body.temperature,
            body.n,
            body.top_p,
            body.logprobs or 0,
            body.seed,
        )
        run = ChoiceRun(engine, job, choices, limiter, wake, call.token)
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model,
        }
        fmt = _LogprobFormat(engine.detokenize) if body.logprobs is not None else None
        if body.stream:
            return StreamingResponse(
                _stream(run, head, fmt, body.include_usage, call), media_type="text/event-stream"
            )
        async for _ in run.events(request.is_disconnected):
            pass
        return {
            **head,
            "choices": [_choice(i, c, fmt) for i, c in enumerate(choices)],
            "usage": usage(prompts, choices),
        }

    completions.__annotations__["body"] = body_type  # this app's max_tokens bound
    app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses=streamed_or_json(400, 401, 404, 503),
        **route_options,
    )(completions)


def check_model(engine: EngineService, model: str) -> None:
    """A 404 before anything is queued (or, streaming, before the stream starts): the
    base, an experiment id, or a published version's name (docs/versions.md)."""
    if model == engine.model_name:
        return
    try:
        engine.get_experiment(model)
    except NotFoundError:
        if "@" not in model and ":" not in model:
            raise
        engine.describe_version(model)  # NotFoundError when it names no version


def _choice(index: int, c: ChoiceText, fmt: _LogprobFormat | None) -> dict[str, Any]:
    lp = fmt.of(c, c.kept_tokens()) if fmt else None
    return {"index": index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}


async def _stream(
    run: ChoiceRun,
    head: dict[str, Any],
    fmt: _LogprobFormat | None,
    include_usage: bool,
    call: ServingCall,
) -> AsyncIterator[str]:
    try:
        async for index in run.events():
            c = run.choices[index]
            piece = c.take()
            if piece.text or piece.tokens or piece.finish_reason:
                lp = fmt.of(c, piece.tokens) if fmt else None
                choice = {"index": index, "text": piece.text, "logprobs": lp}
                yield sse({**head, "choices": [{**choice, "finish_reason": piece.finish_reason}]})
    except Exception as e:
        error = stream_error(e)
        call.failed(error)
        yield sse(error)
        return
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage(run.request.prompts, run.choices)})
    yield sse("[DONE]")


class _LogprobFormat:
    """OpenAI's completions ``logprobs``: tokens, their log-probs, alternatives, offsets."""

    def __init__(self, detokenize: Callable[[list[int]], str]) -> None:
        self.detokenize = detokenize

    def of(self, c: ChoiceText, tokens: list[int]) -> dict[str, Any]:
        return {
            "tokens": [self.detokenize([c.ids[i]]) for i in tokens],
            "token_logprobs": [c.logprobs[i] for i in tokens],
            "top_logprobs": [self._by_text(c.tops[i]) for i in tokens],
            "text_offset": [c.offsets[i] for i in tokens],
        }

    def _by_text(self, top: dict[int, float]) -> dict[str, float]:
        """Alternatives keyed by text, as OpenAI's are: ids that decode alike (byte pieces
        of one character all read "\ufffd") keep the most likely one's log-prob."""
        out: dict[str, float] = {}
        for token, logprob in top.items():
            text = self.detokenize([token])
            out[text] = max(logprob, out.get(text, -float("inf")))
        return out
