"""A small fused training run that can stop at a checkpoint and resume in another process.

Used by test_checkpoint_resume.py:
``python -m tests.support.resume_worker MODEL_DIR CKPT_DIR OUT_FILE [DROPOUT]``
restores every adapter from CKPT_DIR, takes one more step and saves the weights to
OUT_FILE. With DROPOUT > 0 every adapter has that LoRA dropout and the model trains in
training mode, so the step's dropout masks come from torch's global RNG.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.store.checkpoint import (
    atomic_dir,
    load_adapter,
    load_trainer_state,
    save_adapter,
    save_trainer_state,
)
from loraplex_engine.train.optim import AdamWSettings, PerAdapterAdamW
from safetensors.torch import save_file

from tests.support.lora_helpers import CONFIGS, load_base, multi_model, randomise_b

SETTINGS = {
    "a": AdamWSettings(lr=1e-2),
    "b": AdamWSettings(lr=5e-3, weight_decay=0.1),
    "c": AdamWSettings(lr=2e-2, betas=(0.8, 0.95)),
}


def setup(
    model_dir: Path, dropout: float = 0.0
) -> tuple[MultiLoRAModel, PerAdapterAdamW, dict[str, torch.Generator]]:
    model = with_dropout(model_dir, dropout) if dropout else multi_model(model_dir)
    opt = PerAdapterAdamW(model)
    for name, s in SETTINGS.items():
        opt.add_adapter(name, s)
    gens = {name: torch.Generator().manual_seed(i) for i, name in enumerate(SETTINGS)}
    return model, opt, gens


def with_dropout(model_dir: Path, dropout: float) -> MultiLoRAModel:
    """multi_model's adapters a, b, c, each with LoRA dropout, in training mode."""
    model = MultiLoRAModel(load_base(model_dir), max_adapters=4, max_rank=8)
    for i, (name, cfg) in enumerate(CONFIGS.items()):
        model.add_adapter(name, dataclasses.replace(cfg, dropout=dropout), seed=i)
        randomise_b(model, name, seed=100 + i)
    return model.train()


def train_step(model: MultiLoRAModel, opt: PerAdapterAdamW, gens: dict) -> None:
    """Each experiment draws its own 2 rows from its own generator; one fused step for all."""
    ids = torch.cat([torch.randint(4, 200, (2, 8), generator=gens[n]) for n in SETTINGS])
    slots = torch.tensor([model.slot_of(n) for n in SETTINGS for _ in range(2)])
    logits = model(ids, slot_ids=slots).logits
    per_row = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    per_adapter = per_row.mean(1).view(len(SETTINGS), 2).mean(1)  # each adapter's mean loss
    per_adapter.sum().backward()
    opt.step()
    opt.zero_grad()


def save_all(model: MultiLoRAModel, opt: PerAdapterAdamW, gens: dict, root: Path, step: int):
    for name in SETTINGS:
        with atomic_dir(root / name) as tmp:
            save_adapter(model, name, tmp)
            save_trainer_state(tmp, opt, name, generator=gens[name], metadata={"step": step})


def weights(model: MultiLoRAModel) -> dict[str, torch.Tensor]:
    return {f"{n}/{k}": v for n in SETTINGS for k, v in model.adapter_state_dict(n).items()}


def resume(
    model_dir: Path, root: Path, dropout: float = 0.0
) -> tuple[MultiLoRAModel, PerAdapterAdamW, dict, int]:
    model, opt, gens = setup(model_dir, dropout)  # fresh: what follows must come from disk
    steps = set()
    for name in CONFIGS:
        load_adapter(model, name, root / name)
        steps.add(load_trainer_state(root / name, opt, name, generator=gens[name])["step"])
    (step,) = steps
    return model, opt, gens, step


if __name__ == "__main__":
    torch.set_num_threads(1)  # same as the test process: identical float results
    model_dir, root, out = map(Path, sys.argv[1:4])
    dropout = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    model, opt, gens, step = resume(model_dir, root, dropout)
    train_step(model, opt, gens)
    save_file(weights(model), out, metadata={"step": str(step + 1)})
