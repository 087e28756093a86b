"""A Tinker ``asample`` request's prompt and ``sampling_params``, checked strictly at the
door, as the OpenAI routes check theirs (server/openai/api.py): every value typed (no
coercion: ``"hot"`` is not a temperature, ``1.5`` is not a token count), finite and in
range, so nothing a tenant sends can reach the shared rollout and fail the tick for its
co-tenants. Each problem is an ``InvalidRequestError`` (422) naming the field as the
SDK's ``SamplingParams`` spells it (``sampling_params.top_k``); a value is never echoed
whole (:func:`brief`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from loraplex_engine.spec.errors import InvalidRequestError
from loraplex_engine.spec.training_service import Limits, SampleCall

MAX_STOPS = 16  # stop strings or token ids a request may give
MAX_STOP_CHARS = 256
MAX_TEMPERATURE = 100.0  # past it every distribution is flat anyway
MAX_PROMPT_CHUNKS = 1024
ECHO_CHARS = 80  # of an offending value, in an error message
# What torch's generators take (manual_seed): a seed outside it fails where it is used.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_NEW_TOKENS = 2**31 - 1  # the engine's own bound (--max-completion-tokens) is far lower
MAX_TOP_K = 2**31 - 1  # where the vocabulary is not known
STOP_FORMS = (
    f"stop is a string, or a list of at most {MAX_STOPS} strings (1..{MAX_STOP_CHARS} "
    "characters each) or of token ids"
)


def brief(value: object) -> str:
    """``repr(value)`` cut to a few dozen characters: a million-entry shape is not echoed."""
    text = repr(value)
    return text if len(text) <= ECHO_CHARS else f"{text[: ECHO_CHARS - 3]}..."


StopText = Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_CHARS)]
StopId = Annotated[StrictInt, Field(ge=0)]


class SamplingParams(BaseModel):
    """The SDK's ``tinker.types.SamplingParams``; unknown fields are ignored (the SDK adds
    fields over time), known ones are strict."""

    model_config = ConfigDict(extra="ignore", strict=True)

    max_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: (
        StopText
        | Annotated[list[StopText], Field(max_length=MAX_STOPS)]
        | Annotated[list[StopId], Field(max_length=MAX_STOPS)]
        | None
    ) = None
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_k: int = Field(-1, ge=-1)  # -1 (or 0): no cut; at most the vocabulary (below)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)

    @property
    def stop_ids(self) -> list[int]:
        return [s for s in self.stop or [] if isinstance(s, int)]

    @property
    def stop_strings(self) -> list[str]:
        if isinstance(self.stop, str):
            return [self.stop]
        return [s for s in self.stop or [] if isinstance(s, str)]


def _path(loc: tuple[Any, ...]) -> str:
    """pydantic's location as the SDK spells it: ``stop[2]``, without union tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not ("[" in str(part) or str(part).startswith(("constrained-", "str", "int"))):
            out += f".{part}" if out else str(part)
    return out


def sampling_params(raw: object, vocab: int | None) -> SamplingParams:
    """``raw`` (the request's ``sampling_params``) checked; ``vocab``: the model's
    vocabulary size, which bounds ``top_k`` and stop token ids (None: unknown)."""
    where = "sampling_params"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise InvalidRequestError(f"must be an object, not {brief(raw)}", field=where)
    try:
        params = SamplingParams.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        field = _path(tuple(first.get("loc", ())))
        message = first.get("msg", "invalid")
        if field.startswith("stop"):  # a union: pydantic's message is its first member's
            message = STOP_FORMS
        raise InvalidRequestError(
            f"{message} (got {brief(first.get('input'))})",
            field=f"{where}.{field}" if field else where,
        ) from None
    top = vocab if vocab is not None else MAX_TOP_K
    if params.top_k > top:
        raise InvalidRequestError(
            f"top_k {brief(params.top_k)} is over the vocabulary size {top} (-1: no limit)",
            field=f"{where}.top_k",
        )
    if vocab is not None:
        bad = next((i for i, t in enumerate(params.stop_ids) if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {brief(params.stop_ids[bad])} is outside the vocabulary ({vocab})",
                field=f"{where}.stop[{bad}]",
            )
    return params


def prompt_tokens(prompt: object, vocab: int | None, max_tokens: int | None) -> list[int]:
    """The prompt's ``encoded_text`` chunks as token ids: ints in the vocabulary, at
    most ``max_tokens`` of them (counted before any list is built)."""
    chunks = prompt.get("chunks") if isinstance(prompt, dict) else None
    if not isinstance(chunks, list) or not chunks or len(chunks) > MAX_PROMPT_CHUNKS:
        raise InvalidRequestError(
            f"a prompt is 1..{MAX_PROMPT_CHUNKS} chunks of token ids", field="prompt.chunks"
        )
    count = sum(len(c.get("tokens") or []) if isinstance(c, dict) else 0 for c in chunks)
    if max_tokens is not None and count > max_tokens:
        raise InvalidRequestError(
            f"{count} prompt tokens; at most {max_tokens}", field="prompt.chunks"
        )
    tokens: list[int] = []
    for j, chunk in enumerate(chunks):
        where = f"prompt.chunks[{j}]"
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise InvalidRequestError(
                f"{brief(kind)} chunks are not supported (text tokens only)", field=where
            )
        ids = chunk.get("tokens")
        if not isinstance(ids, list):
            raise InvalidRequestError("tokens must be a list of token ids", f"{where}.tokens")
        for i, t in enumerate(ids):
            if type(t) is not int or t < 0 or (vocab is not None and t >= vocab):
                raise InvalidRequestError(
                    f"{brief(t)} is not a token id (0..{vocab - 1 if vocab else 'vocab'})",
                    field=f"{where}.tokens[{i}]",
                )
        tokens.extend(ids)
    if not tokens:
        raise InvalidRequestError("a prompt of token ids is required", field="prompt")
    return tokens


MAX_SAMPLES = 128
MAX_TOPK = 20


def _int(body: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if type(value) is not int or not low <= value <= high:
        raise InvalidRequestError(f"must be an integer {low}..{high}, not {brief(value)}", name)
    return value


def sample_call(body: dict[str, Any], limits: Limits) -> SampleCall:
    """An ``asample`` body as the engine's ``SampleCall``, every field checked."""
    tokens = prompt_tokens(body.get("prompt"), limits.vocab, limits.max_tokens)
    n = _int(body, "num_samples", 1, 1, MAX_SAMPLES)
    topk = _int(body, "topk_prompt_logprobs", 0, 0, MAX_TOPK)
    topk_sampled = _int(body, "topk_sample_logprobs", 0, 0, MAX_TOPK)
    p = sampling_params(body.get("sampling_params"), limits.vocab)
    scored = bool(body.get("prompt_logprobs")) or topk > 0
    last_n = _last_n(body, scored, len(tokens))
    defaults = SampleCall(prompt_ids=tokens)
    return replace(
        defaults,
        num_samples=n,
        max_tokens=defaults.max_tokens if p.max_tokens is None else p.max_tokens,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        seed=p.seed,
        stop_token_ids=p.stop_ids,
        stop_strings=p.stop_strings,
        prompt_logprobs=scored,
        topk_prompt_logprobs=topk,
        prompt_logprobs_last_n=last_n,
        topk_sample_logprobs=topk_sampled,
    )


def _last_n(body: dict[str, Any], scored: bool, prompt_len: int) -> int | None:
    """``prompt_logprobs_last_n`` as the SDK defines it: 1..len(prompt) - 1, and only
    with prompt logprobs asked for (it narrows them)."""
    if body.get("prompt_logprobs_last_n") is None:
        return None
    if prompt_len < 2:
        raise InvalidRequestError(
            "needs a prompt of at least 2 tokens (position 0 is never scored)",
            "prompt_logprobs_last_n",
        )
    n = _int(body, "prompt_logprobs_last_n", 0, 1, prompt_len - 1)
    if not scored:
        raise InvalidRequestError(
            "requires prompt_logprobs (or topk_prompt_logprobs)", "prompt_logprobs_last_n"
        )
    return n
