"""``POST /v1/chat/completions``: OpenAI's chat completions over the chat template.

The messages go through the base model's tokenizer chat template (``engine.chat_prompt``;
a model without one is a 400 saying so), then are served exactly like a completion of
that prompt (``choices.py``). With ``stream: true`` the answer is server-sent events
of ``chat.completion.chunk`` objects (first the assistant role, then content deltas, then
the finish reason), ending with ``data: [DONE]``.
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
from loraplex_engine.server.openai.api import ChatRequestBase, with_token_limit
from loraplex_engine.server.openai.choices import (
    COMPLETION_THREADS,
    ChoiceRequest,
    ChoiceRun,
    ChoiceText,
    sse,
    stream_error,
    usage,
)
from loraplex_engine.server.openai.completions import check_model
from loraplex_engine.spec.service import EngineService


class ChatCompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, int]


def add_chat_route(
    app: FastAPI,
    ready_engine: Callable[[], EngineService],
    *,
    wake: Callable[[], None],
    max_completion_tokens: int,
    route_options: dict[str, Any],
) -> None:
    limiter = anyio.CapacityLimiter(COMPLETION_THREADS)
    body_type = with_token_limit(ChatRequestBase, max_completion_tokens, None)

    async def chat_completions(body: ChatRequestBase, request: Request) -> Any:
        """OpenAI chat completions through the tokenizer's chat template; `model` is an
        experiment id or the base model's name."""
        call = serving_call(request)
        call.model = body.model
        engine = await run_in_threadpool(ready_engine)
        await run_in_threadpool(check_model, engine, body.model)
        messages = [m.for_template() for m in body.messages]
        prompt = await run_in_threadpool(engine.chat_prompt, messages)
        choices = [ChoiceText(engine.detokenize, body.stops) for _ in range(body.n)]
        job = ChoiceRequest(
            body.model,
            [prompt],
            body.token_limit(room_left(engine.context_tokens, len(prompt), max_completion_tokens)),
            body.temperature,
            body.n,
            body.top_p,
            body.alternatives or 0,
            body.seed,
        )
        run = ChoiceRun(engine, job, choices, limiter, wake, call.token)
        created = int(time.time())
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": created, "model": body.model}
        fmt = _ChatLogprobs(engine.detokenize) if body.alternatives is not None else None
        if body.stream:
            chunks = _stream(run, head, fmt, body.include_usage, call)
            return StreamingResponse(chunks, media_type="text/event-stream")
        async for _ in run.events(request.is_disconnected):
            pass
        return {
            **head,
            "object": "chat.completion",
            "choices": [_choice(i, c, fmt) for i, c in enumerate(choices)],
            "usage": usage([prompt], choices),
        }

    chat_completions.__annotations__["body"] = body_type  # this app's token bound
    app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses=streamed_or_json(400, 401, 404, 503),
        **route_options,
    )(chat_completions)


def room_left(context_tokens: int | None, prompt_tokens: int, max_completion_tokens: int) -> int:
    """A chat without ``max_tokens`` may use the context its prompt leaves (as OpenAI's
    does), up to the engine's limit; at least one token, so a full prompt is refused by
    the engine's context check naming ``max_tokens``."""
    if context_tokens is None:
        return max_completion_tokens
    return max(1, min(max_completion_tokens, context_tokens - prompt_tokens))


def _choice(index: int, c: ChoiceText, fmt: _ChatLogprobs | None) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": c.text},
        "logprobs": fmt.of(c, c.kept_tokens()) if fmt else None,
        "finish_reason": c.finish_reason,
    }


async def _stream(
    run: ChoiceRun,
    head: dict[str, Any],
    fmt: _ChatLogprobs | None,
    include_usage: bool,
    call: ServingCall,
) -> AsyncIterator[str]:
    head = {**head, "object": "chat.completion.chunk"}

    def chunk(index: int, delta: dict[str, Any], lp: Any, reason: str | None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        return sse({**head, "choices": [choice]})

    for index in range(len(run.choices)):
        yield chunk(index, {"role": "assistant", "content": ""}, None, None)
    try:
        async for index in run.events():
            c = run.choices[index]
            piece = c.take()
            if piece.text or piece.tokens:
                lp = fmt.of(c, piece.tokens) if fmt else None
                yield chunk(index, {"content": piece.text}, lp, None)
            if piece.finish_reason is not None:
                yield chunk(index, {}, None, piece.finish_reason)
    except Exception as e:
        error = stream_error(e)
        call.failed(error)
        yield sse(error)
        return
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage(run.request.prompts, run.choices)})
    yield sse("[DONE]")


class _ChatLogprobs:
    """OpenAI's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def __init__(self, detokenize: Callable[[list[int]], str]) -> None:
        self.detokenize = detokenize

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.detokenize([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def of(self, c: ChoiceText, tokens: list[int]) -> dict[str, Any]:
        content = []
        for i in tokens:
            alts = [self._entry(t, lp) for t, lp in c.tops[i].items()]
            content.append({**self._entry(c.ids[i], c.logprobs[i]), "top_logprobs": alts})
        return {"content": content}
