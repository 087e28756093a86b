"""Text <-> token ids with the base model's tokenizer, as the engine uses them."""

from __future__ import annotations

from typing import Any

from loraplex_engine.errors import InvalidRequestError


class TokenCodec:
    """Wraps a Hugging Face tokenizer: an empty text encodes to the BOS token (a rollout
    needs at least one prompt token), decoding drops special tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids or [self.tokenizer.bos_token_id]

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
