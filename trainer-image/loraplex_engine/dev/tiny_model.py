"""Build small random-weight causal LMs with a tokenizer trained on the spot.

Used by tests, the demo and the benchmark: no hub downloads, deterministic seed,
saved as an ordinary Hugging Face model directory.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]


@dataclass(frozen=True)
class ModelPreset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    # A wider output head (std, default init 0.02) lets LoRA on the attention/MLP
    # projections alone move the logits (for tests whose adapters leave lm_head out).
    head_std: float | None = None


PRESETS: dict[str, ModelPreset] = {
    # ~0.2M parameters: unit tests and the demo. head_dim 32 (2 heads, 1 KV head): vLLM's
    # CPU attention kernels support head sizes 32, 64, 80, ... only, so vLLM serves the
    # demo's adapters on this base.
    "tiny": ModelPreset(64, 128, 2, 2, 1, 512),
    # The tiny model with a wider output head: the vllm rollout backend's tests.
    "tiny-vllm": ModelPreset(64, 128, 2, 2, 1, 512, head_std=0.2),
    # ~13M parameters (12.95M): big enough that matrix work dominates a CPU step (benchmark).
    "bench": ModelPreset(384, 1024, 8, 6, 2, 2048),
}


def _training_corpus() -> list[str]:
    """Text covering what the built-in tasks print: words, digits, arithmetic, letters."""
    words = [
        "copy",
        "the",
        "answer",
        "is",
        "say",
        "token",
        "target",
        "repeat",
        "sum",
        "of",
        "plus",
        "minus",
        "equals",
        "yes",
        "no",
    ]
    lines = [" ".join(words), string.ascii_letters, string.digits, string.punctuation]
    for a in range(20):
        for b in range(20):
            lines.append(f"{a} + {b} = {a + b}")
            lines.append(f"{a} - {b} = {a - b}")
    lines += [f"say {w} {w} {w}" for w in words]
    lines += [" ".join(string.ascii_lowercase[i : i + 5]) for i in range(22)]
    return lines


# A minimal chat format, so /v1/chat/completions works on the tiny model (a real model
# ships its own template in tokenizer_config.json / chat_template.jinja).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE: any text encodes, so tasks never hit unknown characters."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )


# The model families the engine trains (tests/engine/test_model_families.py), each built
# from its own transformers config class. "llama3" is Llama with a Llama 3-style tokenizer.
ARCHES = ("llama", "llama3", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3")
EOT_TOKEN = "<|eot_id|>"
# Llama 3's shape of template: each turn ends in <|eot_id|>, which also stops generation.
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: "
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


# Qwen3 instruct's chat layout, the one tinker-cookbook's ``qwen3_instruct`` renderer writes
# token by token: each turn is <|im_start|>role\n...<|im_end|>\n, both markers ONE token
# each (the renderer asserts it), and <|im_end|> ends generation.
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATS = ("qwen3",)


def _qwen3_style(tokenizer: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """The same vocabulary with Qwen3 instruct's chat markers: two special tokens added at
    the end (the base vocabulary's ids are unchanged), no BOS, <|im_end|> as EOS."""
    styled = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    styled.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    styled.eos_token = IM_END
    styled.chat_template = QWEN3_CHAT_TEMPLATE
    return styled


def _family_config(arch: str, common: dict[str, Any], head_dim: int) -> PretrainedConfig:
    """``arch``'s own config class at the preset's size."""
    # Gemma's head_dim is free (default 256) and scores scale by query_pre_attn_scalar;
    # its output head is the embedding (vLLM's Gemma always ties them).
    gemma = dict(common, head_dim=head_dim, query_pre_attn_scalar=head_dim)
    gemma["tie_word_embeddings"] = True
    configs: dict[str, Callable[[], PretrainedConfig]] = {
        "llama": lambda: LlamaConfig(**common),
        "llama3": lambda: LlamaConfig(**common),
        "qwen2": lambda: Qwen2Config(**common),
        "qwen3": lambda: Qwen3Config(**common, head_dim=head_dim),
        # Mistral 7B v0.2 on: no sliding window (v0.1's 4096 is the config class default).
        "mistral": lambda: MistralConfig(**common, head_dim=head_dim, sliding_window=None),
        "gemma2": lambda: Gemma2Config(**gemma),
        "gemma3": lambda: Gemma3TextConfig(**gemma),
        "phi3": lambda: Phi3Config(**common),
    }
    if arch not in configs:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHES)}")
    return configs[arch]()


def _llama3_style(tokenizer: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """The same vocabulary the way Llama 3 ships it: no pad token, an end-of-turn token
    that also ends generation, and a chat template."""
    styled = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    styled.add_tokens([EOT_TOKEN], special_tokens=True)
    styled.chat_template = LLAMA3_CHAT_TEMPLATE
    return styled


def build_model(
    out_dir: str | Path,
    preset: str = "tiny",
    arch: str = "llama",
    seed: int = 0,
    chat: str | None = None,
) -> Path:
    """Write a random-weight model + tokenizer to ``out_dir`` and return the path;
    ``chat="qwen3"``: Qwen3 instruct's chat tokens and template (tinker-cookbook's
    ``qwen3_instruct`` renderer renders for it)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if chat is not None and chat not in CHATS:
        raise ValueError(f"unknown chat {chat!r}; choose one of {', '.join(CHATS)}")
    p = PRESETS[preset]
    tokenizer = train_tokenizer(p.vocab_size)
    if arch == "llama3":
        tokenizer = _llama3_style(tokenizer)
    if chat == "qwen3":
        tokenizer = _qwen3_style(tokenizer)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    config = _family_config(arch, common, p.hidden_size // p.num_attention_heads)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if arch == "llama3":  # generation stops at either EOS, as Llama 3 instruct's does
        eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(EOT_TOKEN)]
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=eos
        )
    if chat == "qwen3":  # Qwen3 instruct stops at <|im_end|>
        model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id)
    if p.head_std is not None:
        torch.nn.init.normal_(model.lm_head.weight, std=p.head_std)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
