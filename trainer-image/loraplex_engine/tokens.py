"""Text <-> token ids with the base model's tokenizer, as the engine uses them."""

from __future__ import annotations

from typing import Any


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
