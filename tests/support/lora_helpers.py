"""Shared helpers for the multi-LoRA tests: build models and adapters with nonzero weights,
and check that PEFT loads a saved adapter."""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path

import torch
from loraplex_engine.lora.layers import LoRAConfig
from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.train.rows import TrainRow
from peft import (
    LoraConfig,
    PeftModel,
    get_peft_model,
    get_peft_model_state_dict,
    set_peft_model_state_dict,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Different ranks, alphas and target sets; ranks below the pool's max rank 8.
CONFIGS = {
    "a": LoRAConfig(rank=2, alpha=4.0, target_modules=("q_proj", "v_proj")),
    "b": LoRAConfig(rank=8, alpha=8.0, target_modules=ALL),
    "c": LoRAConfig(rank=4, alpha=16.0, target_modules=("k_proj", "o_proj", "down_proj")),
}


def load_base(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def randomise_b(model: MultiLoRAModel, name: str, seed: int) -> None:
    """Give an adapter a nonzero B (peft init leaves it zero, which would prove nothing)."""
    g = torch.Generator().manual_seed(seed)
    sd = model.adapter_state_dict(name)
    for key, t in sd.items():
        if "lora_B" in key:
            sd[key] = torch.randn(t.shape, generator=g) * 0.2
    model.load_adapter_state_dict(name, sd)


def multi_model(model_dir: Path, max_adapters: int = 4, max_rank: int = 8) -> MultiLoRAModel:
    """A MultiLoRAModel with adapters a, b, c (slots 1, 2, 3), each with random A and B."""
    model = MultiLoRAModel(load_base(model_dir), max_adapters=max_adapters, max_rank=max_rank)
    for i, (name, cfg) in enumerate(CONFIGS.items()):
        model.add_adapter(name, cfg, seed=i)
        randomise_b(model, name, seed=100 + i)
    return model


def peft_model(model_dir: Path, cfg: LoRAConfig, state_dict: dict[str, torch.Tensor]) -> PeftModel:
    """The same adapter alone, in plain peft, on a fresh copy of the base."""
    lc = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
    )
    model = get_peft_model(load_base(model_dir), lc)
    result = set_peft_model_state_dict(model, state_dict)
    assert not result.unexpected_keys
    return model


def batch(rows: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids with left padding on odd rows (like generation batches) and their mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 200, (rows, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[1::2, :2] = 0
    ids[mask == 0] = 0
    return ids, mask


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def random_tick_rows(
    model: MultiLoRAModel,
    names: Iterable[str],
    group_sizes: tuple[int, ...],
    max_prompt: int,
    max_done: int,
) -> list[TrainRow]:
    """A tick's rows, seeded: for each adapter, prompt groups of ``group_sizes`` rows
    sharing a random prompt (2..max_prompt tokens), each with its own completion
    (1..max_done tokens), old log-probs and advantage."""
    rng = random.Random(0)
    rows = []
    for name in names:
        for group, size in enumerate(group_sizes):
            prompt = [rng.randrange(4, 200) for _ in range(rng.randint(2, max_prompt))]
            for _ in range(size):
                done = [rng.randrange(4, 200) for _ in range(rng.randint(1, max_done))]
                old = [rng.uniform(-6.0, -4.0) for _ in done]
                adv = rng.uniform(-1, 1)
                rows.append(TrainRow(name, model.slot_of(name), prompt, done, old, adv, 1.0, group))
    return rows


def assert_peft_adapter_loads(path: Path, model_dir: Path) -> None:
    """PEFT loads the directory onto the tiny base and uses every saved tensor (a key
    PEFT did not recognise would leave its freshly initialised weight in place)."""
    assert path.parent.name == "adapters"
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    loaded = get_peft_model_state_dict(PeftModel.from_pretrained(base, str(path)))
    saved = load_file(path / "adapter_model.safetensors")
    assert saved and set(saved) <= set(loaded)
    for key, value in saved.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0)
