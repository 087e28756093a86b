"""PEFT-format adapters in and out, trainer state, atomic directories, bad checkpoints."""

import json
from pathlib import Path

import pytest
import torch
from loraplex_engine.spec.errors import CheckpointError
from loraplex_engine.store.checkpoint import (
    atomic_dir,
    load_adapter,
    load_trainer_state,
    save_adapter,
    save_trainer_state,
)
from loraplex_engine.train.optim import AdamWSettings, PerAdapterAdamW
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from tests.support.lora_helpers import CONFIGS, batch, load_base, multi_model, rel_err


def _logits(model, ids, mask, slot: int | None = None) -> torch.Tensor:
    with torch.no_grad():
        if slot is None:
            return model(input_ids=ids, attention_mask=mask).logits
        return model(ids, mask, slot_ids=torch.full((len(ids),), slot)).logits


def test_saved_adapter_loads_in_peft_with_same_logits(tiny_model_dir, tmp_path) -> None:
    model = multi_model(tiny_model_dir)
    ids, mask = batch(3, 7)
    for name in CONFIGS:
        out = save_adapter(model, name, tmp_path / name)
        cfg = json.loads((out / "adapter_config.json").read_text())
        assert cfg["r"] == CONFIGS[name].rank and cfg["base_model_name_or_path"]
        peft = PeftModel.from_pretrained(load_base(tiny_model_dir), out)
        ref = _logits(peft, ids, mask)
        assert rel_err(_logits(model, ids, mask, model.slot_of(name)), ref) < 1e-5


def test_peft_saved_adapter_loads_into_a_slot(tiny_model_dir, tmp_path) -> None:
    peft = get_peft_model(
        load_base(tiny_model_dir),
        LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "up_proj", "down_proj"]),
    )
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.2)
    peft.save_pretrained(tmp_path / "peft")
    model = multi_model(tiny_model_dir)
    slot = load_adapter(model, "p", tmp_path / "peft")
    ids, mask = batch(3, 7)
    ref = _logits(peft, ids, mask)
    assert rel_err(ref, _logits(load_base(tiny_model_dir), ids, mask)) > 1e-2
    assert rel_err(_logits(model, ids, mask, slot), ref) < 1e-5


def _state(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()] + [
        layer.scale.clone() for layer in model.lora_layers.values()
    ]


def _corrupt(case: str, src: Path, dst: Path, model_dir: Path) -> None:
    """Copy checkpoint src (an adapter of the model in model_dir) to dst, broken one way."""
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    weights = load_file(src / "adapter_model.safetensors")
    if case == "missing weights":
        weights = None
    elif case == "truncated weights":
        (dst / "adapter_model.safetensors").write_bytes(
            (src / "adapter_model.safetensors").read_bytes()[:100]
        )
        weights = None
    elif case == "wrong shape":
        key = sorted(weights)[0]
        weights[key] = torch.zeros(weights[key].shape[0], 3)
    elif case == "missing key":
        del weights[sorted(weights)[0]]
    elif case == "rank above max":
        cfg["r"] = 64
    elif case == "unknown module":
        cfg["target_modules"] = ["c_attn"]
    elif case == "dora":
        cfg["use_dora"] = True
    elif case == "other base":  # a real peft adapter, same config, made on a wider base
        _save_peft_adapter_of_other_base(src, dst, model_dir)
        cfg = weights = None
    elif case == "bad json":
        cfg = None
        (dst / "adapter_config.json").write_text("{not json")
    if cfg is not None:
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if weights is not None:
        save_file(weights, dst / "adapter_model.safetensors")


def _save_peft_adapter_of_other_base(src: Path, dst: Path, model_dir: Path) -> None:
    """peft's own save of the same LoRA config on a base with hidden size 96, not 64:
    every key matches the tiny model's, the shapes do not."""
    tiny = LlamaConfig.from_pretrained(model_dir)
    wider = LlamaConfig(**{**tiny.to_dict(), "hidden_size": 96, "num_attention_heads": 6})
    torch.manual_seed(0)
    cfg = json.loads((src / "adapter_config.json").read_text())
    lora = LoraConfig(
        r=cfg["r"], lora_alpha=cfg["lora_alpha"], target_modules=cfg["target_modules"]
    )
    get_peft_model(LlamaForCausalLM(wider), lora).save_pretrained(dst)


CORRUPTIONS = {
    "missing weights": "adapter_model.safetensors is missing",
    "truncated weights": "adapter_model.safetensors is corrupt",
    "wrong shape": r"down_proj.lora_A.weight has shape \[4, 3\], expected \[4, 128\]",
    "missing key": "missing keys",
    "rank above max": "rank 64 exceeds the engine's max rank 8",
    "unknown module": r"unknown target modules \['c_attn'\]",
    "dora": "use_dora=True is not supported",
    "bad json": "adapter_config.json is not valid JSON",
    "other base": r"lora_[AB]\.weight has shape \[(4, 96|96, 4)\], expected \[(4, 64|64, 4)\]",
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_bad_adapter_checkpoint_is_rejected_without_change(case, tiny_model_dir, tmp_path):
    model = multi_model(tiny_model_dir)
    good = save_adapter(model, "c", tmp_path / "good")
    _corrupt(case, good, tmp_path / "bad", tiny_model_dir)
    before, adapters = _state(model), model.adapters()
    for name in ("new", "c"):  # into a new slot, and over the existing adapter
        with pytest.raises(CheckpointError, match=CORRUPTIONS[case]):
            load_adapter(model, name, tmp_path / "bad")
    assert model.adapters() == adapters
    assert all(torch.equal(a, b) for a, b in zip(before, _state(model), strict=True))


def test_trainer_state_roundtrip_and_bad_state(tiny_model_dir, tmp_path) -> None:
    model = multi_model(tiny_model_dir)
    opt = PerAdapterAdamW(model)
    opt.add_adapter("a", AdamWSettings(lr=1e-3))
    for p in opt.params:
        p.grad = torch.randn_like(p)
    opt.step([model.slot_of("a")])
    gen = torch.Generator().manual_seed(5)
    save_trainer_state(tmp_path / "s", opt, "a", generator=gen, metadata={"step": 1, "x": "y"})
    expected_draw = torch.rand(3, generator=gen)

    opt2, gen2 = PerAdapterAdamW(model), torch.Generator()
    assert load_trainer_state(tmp_path / "s", opt2, "a", generator=gen2) == {"step": 1, "x": "y"}
    assert opt2.step_count("a") == 1
    assert torch.equal(torch.rand(3, generator=gen2), expected_draw)

    # A state whose moments do not fit adapter "b" (other rank and targets) is rejected.
    opt2.add_adapter("b", AdamWSettings(lr=1e-3))
    with pytest.raises(CheckpointError, match=r"optimizer\.safetensors: optimiser exp_avg"):
        load_trainer_state(tmp_path / "s", opt2, "b")
    assert opt2.step_count("b") == 0
    (tmp_path / "s" / "trainer_state.json").write_text('{"format": 1}')
    with pytest.raises(CheckpointError, match=r"trainer_state\.json: bad trainer state"):
        load_trainer_state(tmp_path / "s", opt2, "a")


def test_trainer_state_restores_the_global_rng_and_refuses_a_missing_or_bad_one(
    tiny_model_dir, tmp_path
) -> None:
    """LoRA dropout draws from torch's global RNG, so it is saved and restored; a state
    without it or with a bad one is refused before anything changes."""
    model = multi_model(tiny_model_dir)
    opt = PerAdapterAdamW(model)
    opt.add_adapter("a", AdamWSettings(lr=1e-3))
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(11)
    save_trainer_state(tmp_path / "s", opt, "a", generator=gen)
    expected_global = torch.rand(3)

    torch.manual_seed(99)
    load_trainer_state(tmp_path / "s", PerAdapterAdamW(model), "a", generator=torch.Generator())
    assert torch.equal(torch.rand(3), expected_global)

    torch.manual_seed(99)
    untouched = torch.get_rng_state()
    opt_untouched = PerAdapterAdamW(model)
    load_trainer_state(tmp_path / "s", opt_untouched, "a", torch.Generator(), global_rng=False)
    assert torch.equal(torch.get_rng_state(), untouched)

    file = tmp_path / "s" / "trainer_state.json"
    state = json.loads(file.read_text())
    del state["globalRng"]
    file.write_text(json.dumps(state))
    opt2 = PerAdapterAdamW(model)
    with pytest.raises(CheckpointError, match=r"bad trainer state: KeyError\('globalRng'\)"):
        load_trainer_state(tmp_path / "s", opt2, "a", generator=torch.Generator())
    assert torch.equal(torch.get_rng_state(), untouched)
    assert "a" not in opt2._slots

    state["globalRng"] = {"cpu": "bm90IGEgc3RhdGU="}  # base64 of "not a state"
    file.write_text(json.dumps(state))
    opt3, gen3 = PerAdapterAdamW(model), torch.Generator().manual_seed(7)
    gen3_state = gen3.get_state()
    with pytest.raises(CheckpointError, match=r"trainer_state\.json: bad trainer state"):
        load_trainer_state(tmp_path / "s", opt3, "a", generator=gen3)
    assert torch.equal(torch.get_rng_state(), untouched)
    assert torch.equal(gen3.get_state(), gen3_state)
    assert "a" not in opt3._slots  # no optimiser state was loaded


def test_atomic_dir_leaves_nothing_half_written(tmp_path) -> None:
    final = tmp_path / "ckpt" / "step-00000001"
    with pytest.raises(RuntimeError), atomic_dir(final) as tmp:
        (tmp / "a.txt").write_text("partial")
        raise RuntimeError("crash mid-write")
    assert not final.exists() and list(final.parent.iterdir()) == []
    with atomic_dir(final) as tmp:
        (tmp / "a.txt").write_text("done")
    assert (final / "a.txt").read_text() == "done"
    with pytest.raises(CheckpointError, match="already exists"), atomic_dir(final):
        pass
    with atomic_dir(final, overwrite=True) as tmp:
        (tmp / "b.txt").write_text("new")
    assert [p.name for p in final.parent.iterdir()] == ["step-00000001"]
    assert [p.name for p in final.iterdir()] == ["b.txt"]
