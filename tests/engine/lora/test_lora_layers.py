"""Mixed-adapter forward and generation equal plain peft with each adapter alone."""

import pytest
import torch
from loraplex_engine.lora.layers import LoRAConfig
from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.spec.errors import (
    DuplicateAdapterError,
    NoFreeSlotError,
    RankTooLargeError,
    RoutingError,
    UnknownAdapterError,
    UnknownTargetModuleError,
)

from tests.support.lora_helpers import (
    ALL,
    CONFIGS,
    batch,
    load_base,
    multi_model,
    peft_model,
    randomise_b,
    rel_err,
)

# Row -> adapter name (None = base). Two rows per adapter, interleaved, plus two base rows.
ROWS = ["a", None, "b", "c", "a", "c", "b", None]


def _slot_ids(model: MultiLoRAModel, rows: list[str | None]) -> torch.Tensor:
    return torch.tensor([model.slot_of(n) if n else 0 for n in rows])


# Row layouts that take each path of the layer: gather + padding (unequal groups), gather
# without padding (equal groups, interleaved), and tenants contiguous (no gather at all).
LAYOUTS = {
    "unequal": ["b", "a", None, "c", "a", "b", "c", "c"],
    "interleaved": ROWS,
    "contiguous": ["a", "a", "b", "b", "c", "c"],
}


@pytest.mark.parametrize(
    ("arch", "layout"),
    [("llama", "unequal"), ("llama", "interleaved"), ("llama", "contiguous"), ("qwen2", "unequal")],
)
def test_mixed_batch_logits_equal_peft_per_adapter(
    arch, layout, tiny_model_dir, tiny_qwen2_dir
) -> None:
    model_dir = tiny_model_dir if arch == "llama" else tiny_qwen2_dir
    rows_of = LAYOUTS[layout]
    model = multi_model(model_dir)
    ids, mask = batch(len(rows_of), 9)
    with torch.no_grad():
        got = model(ids, mask, slot_ids=_slot_ids(model, rows_of)).logits
        base = load_base(model_dir)(input_ids=ids, attention_mask=mask).logits
    for name, cfg in CONFIGS.items():
        ref_model = peft_model(model_dir, cfg, model.adapter_state_dict(name))
        with torch.no_grad():
            ref = ref_model(input_ids=ids, attention_mask=mask).logits
        rows = [i for i, n in enumerate(rows_of) if n == name]
        assert rel_err(ref[rows], base[rows]) > 1e-2  # the adapter really changes the output
        assert rel_err(got[rows], ref[rows]) < 1e-5, name
    base_rows = [i for i, n in enumerate(rows_of) if n is None]
    assert torch.equal(got[base_rows], base[base_rows])


def test_generate_with_kv_cache_equals_peft_greedy(tiny_model_dir) -> None:
    model = multi_model(tiny_model_dir)
    ids, mask = batch(len(ROWS), 6, seed=1)
    kw = {"max_new_tokens": 6, "do_sample": False, "use_cache": True, "pad_token_id": 0}
    got = model.generate(ids, mask, slot_ids=_slot_ids(model, ROWS), **kw)
    for name, cfg in [*CONFIGS.items(), (None, None)]:
        if name is None:
            ref_model = load_base(tiny_model_dir)
        else:
            ref_model = peft_model(tiny_model_dir, cfg, model.adapter_state_dict(name))
        rows = [i for i, n in enumerate(ROWS) if n == name]
        ref = ref_model.generate(input_ids=ids[rows], attention_mask=mask[rows], **kw)
        assert torch.equal(got[rows], ref), name


def test_generate_expands_slots_for_num_return_sequences(tiny_model_dir) -> None:
    model = multi_model(tiny_model_dir)
    ids, mask = batch(2, 5)
    slots = _slot_ids(model, ["a", "b"])
    kw = {"max_new_tokens": 3, "do_sample": True, "pad_token_id": 0}
    out = model.generate(ids, mask, slot_ids=slots, num_return_sequences=3, **kw)
    assert out.shape == (6, 8)


def test_dropout_applies_in_training_only(tiny_model_dir) -> None:
    model = MultiLoRAModel(load_base(tiny_model_dir), max_adapters=2, max_rank=4)
    model.add_adapter("d", LoRAConfig(rank=4, alpha=8, dropout=0.5, target_modules=["q_proj"]))
    layer = model.lora_layers["model.layers.0.self_attn.q_proj"]
    torch.nn.init.normal_(layer.lora_B)
    ids, mask = batch(2, 5)
    slots = torch.tensor([1, 1])
    with torch.no_grad():
        evals = [model(ids, mask, slot_ids=slots).logits for _ in range(2)]
        model.train()
        trains = [model(ids, mask, slot_ids=slots).logits for _ in range(2)]
    assert torch.equal(evals[0], evals[1])
    assert not torch.equal(trains[0], trains[1])


def _snapshot(model: MultiLoRAModel) -> list[torch.Tensor]:
    return [
        t.detach().clone()
        for layer in model.lora_layers.values()
        for t in layer.state_dict().values()
    ] + [layer.scale.clone() for layer in model.lora_layers.values()]


def test_bad_requests_raise_clear_errors_and_change_nothing(tiny_model_dir) -> None:
    model = multi_model(tiny_model_dir, max_adapters=3)
    before, adapters = _snapshot(model), model.adapters()
    cases = [
        (
            RankTooLargeError,
            "rank 16 exceeds the engine's max rank 8",
            lambda: model.add_adapter("x", LoRAConfig(rank=16, alpha=1, target_modules=["q_proj"])),
        ),
        (
            UnknownTargetModuleError,
            r"unknown target modules \['qkv_proj'\]",
            lambda: model.add_adapter(
                "x", LoRAConfig(rank=2, alpha=1, target_modules=["qkv_proj"])
            ),
        ),
        (
            NoFreeSlotError,
            "all 3 adapter slots are taken",
            lambda: model.add_adapter("x", LoRAConfig(rank=2, alpha=1, target_modules=["q_proj"])),
        ),
        (
            DuplicateAdapterError,
            "'a' is already loaded",
            lambda: model.add_adapter("a", CONFIGS["a"]),
        ),
        (UnknownAdapterError, "no adapter named 'zz'", lambda: model.remove_adapter("zz")),
        (
            RoutingError,
            r"slot ids \[5\] hold no adapter",
            lambda: model(torch.ones(1, 3, dtype=torch.long), slot_ids=torch.tensor([5])),
        ),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
    assert model.adapters() == adapters
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(model), strict=True))


def test_remove_then_add_reuses_slot_with_fresh_seeded_weights(tiny_model_dir) -> None:
    model = multi_model(tiny_model_dir)
    slot = model.slot_of("b")
    model.remove_adapter("b")
    assert slot in model.free_slots()
    assert all(layer.lora_B[slot].abs().sum() == 0 for layer in model.lora_layers.values())
    assert model.add_adapter("b2", CONFIGS["b"], seed=7) == slot
    first = model.adapter_state_dict("b2")
    model.remove_adapter("b2")
    model.add_adapter("b2", CONFIGS["b"], seed=7)
    again = model.adapter_state_dict("b2")
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert all(again[k].abs().sum() == 0 for k in again if "lora_B" in k)  # peft init: B = 0


# Adapters a and c (and base rows) only: b's slot is not in the batch, so nothing that
# happens to it may change these rows' computation, bit for bit.
KEPT_ROWS = ["a", "c", None, "c", "a"]


def _kept_state(model: MultiLoRAModel, ids, mask) -> dict[str, torch.Tensor]:
    """Every per-slot buffer of a and c (padding past the rank included) and the logits."""
    out = {}
    for name in ("a", "c"):
        slot = model.slot_of(name)
        for path, layer in model.lora_layers.items():
            for key in ("lora_A", "lora_B", "scale", "dropout"):
                out[f"{name}/{path}/{key}"] = getattr(layer, key)[slot].detach().clone()
    with torch.no_grad():
        out["logits"] = model(ids, mask, slot_ids=_slot_ids(model, KEPT_ROWS)).logits
    return out


def test_changing_one_slot_leaves_the_others_bit_for_bit(tiny_model_dir) -> None:
    """remove, add (into the freed slot, seeded or not) and load weights of one adapter never
    touch another adapter's slot nor the rows routed to it."""
    model = multi_model(tiny_model_dir)
    ids, mask = batch(len(KEPT_ROWS), 9)
    before = _kept_state(model, ids, mask)

    def unchanged(after_what: str) -> None:
        after = _kept_state(model, ids, mask)
        for key, t in before.items():
            assert torch.equal(after[key], t), f"{key} changed after {after_what}"

    slot_b = model.slot_of("b")
    model.remove_adapter("b")
    unchanged("remove_adapter('b')")
    # Largest rank, every target, dropout: it writes every layer's slot, all columns.
    d = LoRAConfig(rank=8, alpha=3.0, dropout=0.2, target_modules=ALL)
    assert model.add_adapter("d", d, seed=3) == slot_b
    unchanged("add_adapter('d')")
    randomise_b(model, "d", seed=9)
    unchanged("load_adapter_state_dict('d')")
    model.remove_adapter("d")
    model.add_adapter("d", d)  # unseeded: draws from torch's global RNG
    unchanged("add_adapter('d') unseeded")
