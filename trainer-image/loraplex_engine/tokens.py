"""Text <-> token ids with the base model's tokenizer, as the engine uses them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from loraplex_engine.spec.errors import InvalidRequestError


class ChatTemplates(Protocol):
    """What a check of the chat template reads: whether the model has one, and the
    tokenizer that renders it (a TokenCodec, or base_model.TemplateFiles before the
    model loads)."""

    @property
    def has_chat_template(self) -> bool: ...

    @property
    def tokenizer(self) -> Any: ...


class TokenCodec:
    """Wraps a Hugging Face tokenizer: an empty text encodes to the BOS token (a rollout
    needs at least one prompt token), decoding drops special tokens.

    ``extra_eos_ids``: the generation config's ``eos_token_id`` (an int or a list: Llama 3
    stops at ``<|eot_id|>`` and ``<|end_of_text|>``); every one of them and the tokenizer's
    own EOS end a completion."""

    def __init__(self, tokenizer: Any, extra_eos_ids: int | Iterable[int] | None = None) -> None:
        self.tokenizer = tokenizer
        ids = [tokenizer.eos_token_id, *_as_list(extra_eos_ids)]
        self.eos_ids: tuple[int, ...] = tuple(sorted({int(i) for i in ids if i is not None}))
        self.pad_id = _pad_id(tokenizer, self.eos_ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids or [self.tokenizer.bos_token_id]

    def encode_prompt(self, text: str, chat_template: bool) -> list[int]:
        """A task prompt's ids: raw, or as one user message through the chat template with
        the assistant turn opened (``task.chatTemplate``)."""
        if not chat_template:
            return self.encode(text)
        rendered = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        # The template writes its own BOS and turn markers: add no special tokens again.
        return self.tokenizer(rendered, add_special_tokens=False).input_ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def prompt_ids(self, prompt: str | list[int], field: str = "prompt") -> list[int]:
        """A served prompt: text is encoded; token ids must be the model's."""
        if isinstance(prompt, str):
            return self.encode(prompt)
        vocab = len(self.tokenizer)
        bad = next((i for i, t in enumerate(prompt) if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {prompt[bad]} is outside the model's vocabulary (0..{vocab - 1})",
                field=f"{field}[{bad}]",
            )
        return list(prompt) or [self.tokenizer.bos_token_id]

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation through the tokenizer's chat template, ready for the reply."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "this model's tokenizer has no chat template: use /v1/completions",
                field="messages",
            )
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer(text, add_special_tokens=False).input_ids or self.encode("")


def _as_list(ids: int | Iterable[int] | None) -> list[int]:
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def _pad_id(tokenizer: Any, eos_ids: tuple[int, ...]) -> int:
    """The tokenizer's pad token; else (Llama 3 has none) its EOS, else its UNK, else 0.
    Any id is safe: padded positions are masked out of attention and of the loss, and a
    finished row's padding is cut off its completion."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id, *eos_ids):
        if candidate is not None:
            return int(candidate)
    unk = getattr(tokenizer, "unk_token_id", None)
    return int(unk) if unk is not None else 0
