"""A base model directory, read before its weights load: is it one, what can LoRA target,
and what an adapter that names no targets gets (the family default).

The command line checks a model directory and every manifest's target modules before it
loads anything, so a typo is a one-line error in a second or two, not a traceback after
the weights have loaded. The module names come from the model built on torch's meta
device: the real module tree from ``config.json``, with no weights read or allocated.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from loraplex_engine.spec.api_types import ModelShape
from loraplex_engine.spec.errors import UsageError

CONFIG_FILE = "config.json"
# Where a transformers tokenizer reads its chat template from (tokenization_utils_base):
# its own file, a folder of named ones, the tokenizer config's entry; a processor's legacy
# file is counted too (a template that may be there is the tokenizer's to decide).
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
TEMPLATE_DIR = "additional_chat_templates"
TOKENIZER_CONFIG = "tokenizer_config.json"

# An adapter that names no target modules gets the attention's query and value projections
# (the LoRA paper's choice), under the names its family gives them: separate q_proj and
# v_proj (Llama 3, Qwen2.5, Qwen3, Mistral, Gemma 2/3) or the fused qkv_proj (Phi-3).
# Resolved against the module names the base model has, so any family that names its
# projections either way gets a working default; the first set fully present wins.
DEFAULT_TARGET_CANDIDATES: tuple[tuple[str, ...], ...] = (("q_proj", "v_proj"), ("qkv_proj",))


def check_model_dir(path: str | Path) -> Path:
    """``path`` as a Path if it is a Hugging Face model directory, else ``UsageError``."""
    model_dir = Path(path)
    if not model_dir.exists():
        raise UsageError(f"model directory {model_dir} does not exist")
    if not model_dir.is_dir():
        raise UsageError(f"model directory {model_dir} is not a directory")
    if not (model_dir / CONFIG_FILE).is_file():
        raise UsageError(f"model directory {model_dir} has no {CONFIG_FILE}")
    return model_dir


# A served name: a hub id (org/model) or one plain name, as recipes spell models; no ':'
# (clients cut a name at ':' to drop a checkpoint suffix) and no path.
_SERVED_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")
# A Hugging Face hub cache snapshot: <cache>/models--<org>--<name>/snapshots/<revision>
_HUB_CACHE_REPO = re.compile(r"models--([^/]+?)--([^/]+)")


def hub_id_of(model_dir: str | Path) -> str | None:
    """The hub id (``org/model``) a model directory is a copy of, where it says: its
    config's ``_name_or_path``, or the hub cache's layout around it; else None."""
    path = Path(model_dir).resolve()
    try:
        config = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    named = config.get("_name_or_path") if isinstance(config, dict) else None
    if isinstance(named, str) and "/" in named and _SERVED_NAME.fullmatch(named):
        return named
    repo = _HUB_CACHE_REPO.fullmatch(path.parent.parent.name)
    if path.parent.name == "snapshots" and repo is not None:
        return f"{repo.group(1)}/{repo.group(2)}"
    return None


def served_names(model_dir: str | Path, given: Sequence[str]) -> tuple[str, ...]:
    """The names ``serve`` serves the base model under, the first its own: those given
    (``--served-model-name``, repeatable or comma-separated), else the model's hub id, else
    its directory's name. UsageError names the flag for a name no client could send."""
    names: list[str] = []
    for item in (part.strip() for entry in given for part in entry.split(",")):
        if not item:
            continue
        if not _SERVED_NAME.fullmatch(item):
            raise UsageError(
                f"--served-model-name {item!r}: a name is 'org/model' or 'model', letters, "
                "digits, '.', '_' or '-', each part 1-96 characters"
            )
        if item not in names:
            names.append(item)
    if names:
        return tuple(names)
    return (hub_id_of(model_dir) or Path(model_dir).resolve().name,)


def lora_targets_of(model_dir: str | Path) -> list[str]:
    """The LoRA target names (``multi_lora.adaptable_module_names``) of the model in
    ``model_dir``, read from its config without loading its weights."""
    path = check_model_dir(model_dir)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError) as exc:  # unreadable JSON, an unknown architecture
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"model directory {path}: {CONFIG_FILE}: {first_line}") from None
    from loraplex_engine.lora.model import adaptable_module_names

    return adaptable_module_names(base)


def context_tokens_of(model_dir: str | Path) -> int | None:
    """The longest row the model takes, as the loaded engine reads it (its config's
    ``max_position_embeddings``; None: not stated), from the config alone (imports torch:
    transformers' config classes do)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(check_model_dir(model_dir))
    return getattr(config, "max_position_embeddings", None)


def tokenizer_of(model_dir: str | Path) -> Any:
    """The model's tokenizer alone, no weights: what `run` checks chat templates with
    before its model loads. With a ``tokenizer.json`` the tokenizers backend reads it, its
    config and its chat template without importing torch (AutoTokenizer does: it builds
    the model's config class); without one, AutoTokenizer."""
    path = check_model_dir(model_dir)
    try:
        if (path / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"model directory {path}: its tokenizer: {first_line}") from None


def model_shape_of(config: Any) -> ModelShape | None:
    """The dimensions of a transformers decoder config (Llama, Qwen, Mistral, ...), for the
    operator's adapter memory estimate; None when the config lacks them."""
    layers = getattr(config, "num_hidden_layers", None)
    hidden = getattr(config, "hidden_size", None)
    if not isinstance(layers, int) or not isinstance(hidden, int):
        return None
    heads = getattr(config, "num_attention_heads", None) or 1
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return ModelShape(
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=getattr(config, "intermediate_size", None) or 4 * hidden,
        kv_dim=min(kv_heads * head_dim, hidden),  # the pool's schema: kvDim <= hiddenSize
    )


def default_lora_targets(module_names: Iterable[str]) -> tuple[str, ...] | None:
    """The target modules an adapter without ``targetModules`` gets on a base model whose
    adaptable modules are ``module_names``; None if it has none of the candidates."""
    names = set(module_names)
    return next((c for c in DEFAULT_TARGET_CANDIDATES if names.issuperset(c)), None)


# Weight files a fingerprint covers, and how much of each it reads (a safetensors header,
# with every tensor's name, dtype, shape and offsets, sits at the start).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
_HEAD_BYTES = 1 << 20


def fingerprint(model_dir: str | Path) -> str:
    """A version manifest's ``baseModelHash``: sha256 over ``config.json`` and each weight
    file's name, size and first MiB. Cheap (a 14 GB model is not read whole at every
    start), and it tells apart any two models of different config, shapes, dtypes or
    files; a same-shaped model with other weights in the same files is not told apart."""
    import hashlib

    root = Path(model_dir)
    h = hashlib.sha256((root / CONFIG_FILE).read_bytes())
    for file in sorted(p for p in root.iterdir() if p.suffix in _WEIGHT_SUFFIXES):
        h.update(f"\0{file.name}\0{file.stat().st_size}\0".encode())
        with open(file, "rb") as f:
            h.update(f.read(_HEAD_BYTES))
    return "sha256:" + h.hexdigest()


class TemplateFiles:
    """A model directory's chat template as `run` checks it before its model loads:
    whether there is one, from its files (transformers, a second or more to import, is
    not needed to say there is none), and the tokenizer that renders it, read only when
    a check renders the template (environments/observations.check_chat_templates)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = check_model_dir(model_dir)
        self.has_chat_template = _has_template_file(self.model_dir)

    @cached_property
    def tokenizer(self) -> Any:
        return tokenizer_of(self.model_dir)


def _has_template_file(path: Path) -> bool:
    """Whether ``path`` holds a chat template where its tokenizer reads one; a config
    that cannot be read says yes (the tokenizer, read later, names its problem)."""
    if any((path / name).is_file() and (path / name).stat().st_size for name in TEMPLATE_FILES):
        return True
    named = path / TEMPLATE_DIR
    if named.is_dir() and any(f.suffix == ".jinja" for f in named.iterdir()):
        return True
    config = path / TOKENIZER_CONFIG
    if not config.is_file():
        return False
    try:
        return bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return True
