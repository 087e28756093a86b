"""Serving OpenAI choices from the engine: sampled tokens → text, stop strings, log-probs.

A request's prompts each become one ``engine.complete`` call with a ``PromptJob`` (``n``
rows; spec/service.py) in a worker thread; the engine serves it in its next rollout batch. The
torch backend reports every token as its decode step makes it (``PromptJob.on_token``,
from the tick's thread, handed to the event loop without blocking), so a stream's chunks
leave while the row is still decoding; the vLLM backend answers whole rows, which are fed
in at the end.

Stop strings apply to the decoded text, as OpenAI does: the text ends before the first
stop string, ``finish_reason`` is ``"stop"``, and the row is cancelled at once (it frees
its place in the batch). While streaming, a text end that could still become a stop
string is held back until it cannot. A client that leaves cancels its rows the same way.
Usage counts the sampled token ids.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from loraplex_engine.spec.service import EngineService, PromptJob, ServedRow

COMPLETION_THREADS = 32
DISCONNECT_POLL_S = 1.0


@dataclass
class Piece:
    """What a choice has ready to send: new text, the indices of its new tokens, and its
    finish reason the first time it is known (once per choice)."""

    text: str
    tokens: list[int]
    finish_reason: str | None = None


@dataclass
class ChoiceText:
    """One choice as its tokens arrive: decoded text, stop strings, per-token data."""

    detokenize: Callable[[list[int]], str]
    stops: list[str]
    prefix: str = ""  # the prompt's text, with echo
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[dict[int, float]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # each token's start in ``text``
    text: str = ""
    stopped: bool = False
    finish_reason: str | None = None
    completion_tokens: int = 0
    _sent_chars: int = 0
    _sent_tokens: int = 0
    _sent_finish: bool = False

    def __post_init__(self) -> None:
        self.text = self.prefix

    def add(self, token: int, logprob: float, top: dict[int, float] | None) -> None:
        if self.stopped or self.finish_reason is not None:
            return
        self.offsets.append(len(self.text.rstrip("\ufffd")))
        self.ids.append(token)
        self.logprobs.append(logprob)
        self.tops.append(top or {})
        self.text = self.prefix + self.detokenize(self.ids)
        self._apply_stops()

    def _apply_stops(self) -> None:
        longest = max((len(s) for s in self.stops), default=0)
        start = max(len(self.prefix), self._sent_chars - longest)
        hits = [i for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def finish(self, completion: ServedRow | None) -> None:
        """The row's final answer (None: the job was dropped before decoding)."""
        if completion is not None:
            for i in range(len(self.ids), len(completion.token_ids)):  # not streamed
                top = completion.top_logprobs[i] if completion.top_logprobs else None
                lp = completion.logprobs[i] if i < len(completion.logprobs) else float("nan")
                self.add(completion.token_ids[i], lp, top)
            self.completion_tokens = len(completion.token_ids)
        reason = completion.finish_reason if completion is not None else "stop"
        self.finish_reason = "stop" if self.stopped or reason != "length" else "length"

    def take(self) -> Piece:
        """The text (and its tokens) that can be sent now and was not sent yet."""
        final = self.finish_reason is not None or self.stopped
        safe = len(self.text) if final else self._safe_end()
        tokens = [i for i in range(self._sent_tokens, len(self.ids)) if self._within(i, safe)]
        reason = None if self._sent_finish else self.finish_reason
        piece = Piece(self.text[self._sent_chars : safe], tokens, reason)
        self._sent_chars = max(self._sent_chars, safe)
        self._sent_tokens = tokens[-1] + 1 if tokens else self._sent_tokens
        self._sent_finish = self._sent_finish or reason is not None
        return piece

    def _within(self, token: int, end: int) -> bool:
        """Whether a token's text starts before ``end`` (all of them, once finished
        without a stop string: an end-of-sequence token has no text)."""
        if self.finish_reason is not None and not self.stopped:
            return True
        return self.offsets[token] < end

    def _safe_end(self) -> int:
        """Hold back a partial character and a tail that may begin a stop string."""
        text = self.text.rstrip("\ufffd")
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return max(self._sent_chars, len(text) - hold)

    def kept_tokens(self) -> list[int]:
        """Indices of the tokens whose text is in the answer (a stop cuts the rest)."""
        return [i for i in range(len(self.ids)) if self._within(i, len(self.text))]


@dataclass
class ChoiceRequest:
    """One request's jobs: the prompts' token ids and how to sample them."""

    model: str
    prompts: list[list[int]]
    max_tokens: int
    temperature: float
    n: int
    top_p: float
    alternatives: int
    seed: int | None


class ChoiceRun:
    """Runs a request's jobs and yields the index of every choice with news."""

    def __init__(
        self,
        engine: EngineService,
        request: ChoiceRequest,
        choices: list[ChoiceText],
        limiter: anyio.CapacityLimiter,
        wake: Callable[[], None],
        on_token: Callable[[], None] = lambda: None,
    ) -> None:
        """``on_token``: called (on the event loop) with each choice's news, so the first
        call is the first token, streamed or not (server/observe.py's time to it)."""
        self.engine, self.request, self.choices = engine, request, choices
        self.limiter, self.wake, self.on_token = limiter, wake, on_token
        self.cancelled = [False] * len(choices)
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    async def events(
        self, disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[int]:
        loop = asyncio.get_running_loop()
        tasks = [
            asyncio.ensure_future(self._job(i, ids, loop))
            for i, ids in enumerate(self.request.prompts)
        ]
        self.wake()
        try:
            remaining = len(tasks)
            while remaining:
                try:
                    kind, value = await asyncio.wait_for(self._queue.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    if disconnected is not None and await disconnected():
                        return
                    continue
                if kind == "error":
                    raise value
                self.on_token()
                if kind == "done":
                    remaining -= 1
                    first = value * self.request.n
                    for index in range(first, first + self.request.n):
                        yield index
                else:
                    yield value
        finally:
            self.cancelled[:] = [True] * len(self.cancelled)  # frees the rows still decoding
            for t in tasks:
                t.cancel()

    async def _job(self, prompt: int, ids: list[int], loop: asyncio.AbstractEventLoop) -> None:
        first = prompt * self.request.n
        req = self.request

        def on_token(row: int, token: int, logprob: float, top: dict[int, float] | None) -> None:
            loop.call_soon_threadsafe(self._token, first + row, token, logprob, top)

        job = PromptJob(
            req.model,
            ids,
            req.max_tokens,
            req.temperature,
            req.n,
            top_p=req.top_p,
            top_logprobs=req.alternatives,
            seed=req.seed,
            on_token=on_token,
            cancelled=lambda row: self.cancelled[first + row],
        )
        try:
            results = await anyio.to_thread.run_sync(
                self.engine.complete, job, limiter=self.limiter
            )
        except Exception as e:  # answered through the event stream
            self._queue.put_nowait(("error", e))
            return
        for row in range(req.n):
            self.choices[first + row].finish(results[row] if row < len(results) else None)
        self._queue.put_nowait(("done", prompt))

    def _token(self, index: int, token: int, logprob: float, top: dict[int, float] | None) -> None:
        choice = self.choices[index]
        choice.add(token, logprob, top)
        if choice.stopped:
            self.cancelled[index] = True
        self._queue.put_nowait(("token", index))


def usage(prompts: list[list[int]], choices: list[ChoiceText]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event, as OpenAI streams them (``[DONE]`` ends the stream)."""
    import json

    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def stream_error(exc: Exception) -> dict[str, Any]:
    """An error after the stream began (the status line is gone): OpenAI's error event."""
    from loraplex_engine.server.errors import error_body, http_status
    from loraplex_engine.spec.errors import ApiError

    if isinstance(exc, ApiError):
        return error_body(exc.code, exc.message, exc.field, http_status(exc))
    return error_body("internal", f"internal error ({type(exc).__name__})", None, 500)
