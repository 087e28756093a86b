"""A small fused training run that can stop at a checkpoint and resume in another process.

Used by test_checkpoint_resume.py: ``python resume_worker.py MODEL_DIR CKPT_DIR OUT_FILE``
restores every adapter from CKPT_DIR, takes one more step and saves the weights to OUT_FILE.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from lora_helpers import CONFIGS, multi_model
from loraplex_engine.checkpoint import (
    atomic_dir,
    load_adapter,
    load_trainer_state,
    save_adapter,
    save_trainer_state,
)
from loraplex_engine.multi_lora import MultiLoRAModel
from loraplex_engine.optim import AdamWSettings, PerAdapterAdamW
from safetensors.torch import save_file

SETTINGS = {
    "a": AdamWSettings(lr=1e-2),
    "b": AdamWSettings(lr=5e-3, weight_decay=0.1),
    "c": AdamWSettings(lr=2e-2, betas=(0.8, 0.95)),
}


def setup(model_dir: Path) -> tuple[MultiLoRAModel, PerAdapterAdamW, dict[str, torch.Generator]]:
    model = multi_model(model_dir)
    opt = PerAdapterAdamW(model)
    for name, s in SETTINGS.items():
        opt.add_adapter(name, s)
    gens = {name: torch.Generator().manual_seed(i) for i, name in enumerate(SETTINGS)}
    return model, opt, gens


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


def resume(model_dir: Path, root: Path) -> tuple[MultiLoRAModel, PerAdapterAdamW, dict, int]:
    model, opt, gens = setup(model_dir)  # fresh init: everything below must come from disk
    steps = set()
    for name in CONFIGS:
        load_adapter(model, name, root / name)
        steps.add(load_trainer_state(root / name, opt, name, generator=gens[name])["step"])
    (step,) = steps
    return model, opt, gens, step


if __name__ == "__main__":
    torch.set_num_threads(1)  # same as the test process: identical float results
    model_dir, root, out = map(Path, sys.argv[1:])
    model, opt, gens, step = resume(model_dir, root)
    train_step(model, opt, gens)
    save_file(weights(model), out, metadata={"step": str(step + 1)})
