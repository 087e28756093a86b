"""The grouped-matmul LoRA path (lora/grouped.py) against the bmm path it replaces on CUDA.

The selection is pure and checked branch by branch. The grouped algorithm runs here
through its reference loop (``always`` on a CPU) and through torch's own ``_grouped_mm``
(which this torch also has on the CPU, as a loop), and must give the bmm path's output
and gradients: tightly in fp32, within bf16's rounding in bf16. The fused CUDA kernel is
checked the same way where an sm90/sm100 GPU is present.
"""

from __future__ import annotations

import pytest
import torch
from loraplex_engine.lora import grouped as grouped_lora
from loraplex_engine.lora import layers as lora
from loraplex_engine.lora.gradient_checkpointing import gradient_checkpointing
from loraplex_engine.lora.grouped import (
    KernelEnv,
    can_use_grouped_mm,
    choose_path,
    delta_flops,
    grouped_mm_blocker,
    kernel_rank,
    rank_runs,
    reference_grouped_mm,
)
from loraplex_engine.lora.layers import LoRAConfig, MultiLoRALinear
from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.lora.routing import Router, Routing
from loraplex_engine.spec.errors import AdapterError
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from tests.support.lora_helpers import load_base, randomise_b

H100 = KernelEnv("cuda", (9, 0), True, False)
SHAPES = (4096, 1024, 64)
BF16 = torch.bfloat16

# ---- selection -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "dtype", "shapes", "why"),
    [
        (H100, BF16, SHAPES, None),
        (KernelEnv("cuda", (10, 0), True, False), BF16, SHAPES, None),
        (KernelEnv("cpu", None, True, False), BF16, SHAPES, "not on CUDA"),
        (KernelEnv("cuda", (9, 0), False, False), BF16, SHAPES, "no torch._grouped_mm"),
        (KernelEnv("cuda", (9, 4), True, True), BF16, SHAPES, "ROCm"),
        (H100, torch.float16, SHAPES, "bf16-only"),
        (H100, torch.float32, SHAPES, "bf16-only"),
        (KernelEnv("cuda", (8, 0), True, False), BF16, SHAPES, "sm90/sm100"),
        (KernelEnv("cuda", (12, 0), True, False), BF16, SHAPES, "sm90/sm100"),
        (H100, BF16, (4100, 1024, 64), "multiples of 8"),
        (H100, BF16, (4096, 1030, 64), "multiples of 8"),
        (H100, BF16, (4096, 1024, 60), "multiples of 8"),
    ],
)
def test_the_fused_kernel_runs_only_where_torch_has_it(env, dtype, shapes, why) -> None:
    blocker = grouped_mm_blocker(env, dtype, shapes)
    assert can_use_grouped_mm(env, dtype, shapes) is (why is None)
    assert blocker is None if why is None else why in blocker


@pytest.mark.parametrize(
    ("mode", "blocker", "path"),
    [
        ("never", None, "bmm"),
        ("never", "not on CUDA", "bmm"),
        ("auto", None, "grouped"),
        ("auto", "not on CUDA", "bmm"),
        ("always", None, "grouped"),
        ("always", "not on CUDA", "reference"),
    ],
)
def test_choose_path(mode, blocker, path) -> None:
    assert choose_path(mode, blocker) == path


def test_a_bad_mode_names_the_setting() -> None:
    with pytest.raises(AdapterError, match="grouped_mm must be one of"):
        choose_path("fast", None)
    with pytest.raises(AdapterError, match="grouped_mm"):
        MultiLoRALinear(nn.Linear(8, 8), 2, 8, grouped_mm="yes")


def test_a_cpu_layer_keeps_the_bmm_path_unless_told() -> None:
    layer = MultiLoRALinear(nn.Linear(64, 64), 2, 8)
    assert layer.path(BF16) == layer.path(torch.float32) == "bmm"
    layer.grouped_mm = "always"
    assert layer.path(BF16) == "reference"


def test_ranks_are_aligned_and_runs_merge_equal_neighbours() -> None:
    assert [kernel_rank(r, 64) for r in (0, 1, 8, 9, 16, 60, 64)] == [0, 8, 8, 16, 16, 64, 64]
    assert kernel_rank(5, 6) == 6  # never past the slot's columns
    assert rank_runs([8, 8, 64, 0, 16, 16, 8]) == [(8, 0, 2), (64, 2, 3), (16, 4, 6), (8, 6, 7)]
    assert rank_runs([0, 0]) == []


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_the_reference_loop_is_torchs_grouped_mm(dtype) -> None:
    """Same ``offs`` semantics (end rows, an empty group allowed) as the real op."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(40, 16, generator=g).to(dtype)
    b = torch.randn(3, 16, 8, generator=g).to(dtype)
    offs = torch.tensor([10, 10, 40], dtype=torch.int32)
    assert torch.equal(reference_grouped_mm(a, b, offs), torch._grouped_mm(a, b, offs=offs))


# ---- the layer: grouped == bmm -------------------------------------------------------

# slot -> rank, max rank 64: slots 1 and 2 share one run (rank 4 is computed at 8, the
# kernel's alignment); slot 5's adapter does not target the layer (rank 0 here).
RANKS = {1: 8, 2: 4, 3: 64, 4: 16, 5: 0, 6: 16}
ADAPTER_RANKS = RANKS | {5: 32}  # what the router knows: slot 5's adapter has a rank
ROUTINGS = {
    "dense in order": [1, 1, 2, 2, 3, 3, 4, 4, 6, 6],
    "dense shuffled": [3, 1, 2, 6, 4, 2, 1, 4, 3, 6],
    "sparse with base rows": [2, 0, 1, 1, 3, 4, 2, 0, 6, 6, 6],
    "one slot": [3, 3, 3],
    # slot 5's group (no delta) sits between two runs of rank 16
    "an untargeted slot": [1, 5, 5, 4, 0, 6, 3],
}


def _layer(dtype: torch.dtype, device: str = "cpu", dropout: float = 0.0) -> MultiLoRALinear:
    torch.manual_seed(0)
    base = nn.Linear(64, 48, bias=False, device=device).to(dtype)
    layer = MultiLoRALinear(base, 7, 64, dtype=torch.float32)
    for slot, rank in RANKS.items():
        if not rank:
            layer.set_slot(slot, 0, 0.0, 0.0)  # an adapter that targets other modules
            continue
        layer.set_slot(slot, rank, 2.0 * slot / rank, dropout)  # alphas differ per slot
        with torch.no_grad():
            layer.lora_B[slot, :, :rank].normal_(std=0.5)
    return layer


def _run(layer, slots, mode, x, loss="square"):
    """Output and gradients (input, A, B) of one routed forward and backward."""
    layer.grouped_mm = mode
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    layer.router = Router(torch.tensor(slots, device=x.device), ADAPTER_RANKS)
    y = layer(x)
    layer.router = None
    (y.float().square().sum() if loss == "square" else y.sum()).backward()
    return [y.float(), x.grad.float(), layer.lora_A.grad.clone(), layer.lora_B.grad.clone()]


def _assert_close(got, ref, rtol: float) -> None:
    for name, g, r in zip(("output", "x.grad", "A.grad", "B.grad"), got, ref, strict=True):
        assert r.abs().sum() > 0, name
        err = ((g - r).norm() / r.norm()).item()
        assert err <= rtol, (name, err)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float32, 1e-6), (BF16, 2e-2)])
def test_grouped_reference_equals_bmm(routing, dtype, rtol) -> None:
    """fp32: the same products in another order. bf16: both round their intermediates to
    bf16 (8 bits of mantissa, ~0.4% each), so a 2% relative bound on every tensor (the CPU
    accumulates in fp32 either way and is exact here; a GPU kernel may sum differently)."""
    layer = _layer(dtype)
    x = torch.randn(len(ROUTINGS[routing]), 5, 64).to(dtype)
    ref = _run(layer, ROUTINGS[routing], "never", x)
    got = _run(layer, ROUTINGS[routing], "always", x)
    _assert_close(got, ref, rtol)
    # Padding past each slot's rank stays exactly zero (its gradient is zero).
    for slot, rank in RANKS.items():
        assert not got[2][slot, rank:].any() and not got[3][slot, :, rank:].any()


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_torchs_grouped_mm_through_the_layer_equals_bmm(monkeypatch, dtype) -> None:
    """The real op (its CPU loop here), its ``offs`` and strides, and its backward fed the
    stride-0 gradient of ``sum()``, which the kernel rejects unless made dense."""
    monkeypatch.setattr(lora, "grouped_mm_blocker", lambda *_: None)
    layer = _layer(dtype)
    slots = ROUTINGS["sparse with base rows"]
    x = torch.randn(len(slots), 3, 64).to(dtype)
    assert layer.path(dtype) == "grouped"
    for loss in ("square", "sum"):
        ref = _run(layer, slots, "never", x, loss)
        got = _run(layer, slots, "auto", x, loss)
        _assert_close(got, ref, 1e-6 if dtype == torch.float32 else 2e-2)


def test_per_slot_dropout_masks_are_the_same_on_both_paths() -> None:
    """Dropout is drawn on the gathered rows before grouping: same seed, same masks."""
    layer = _layer(torch.float32, dropout=0.3).train()
    slots = [4, 0, 1, 6, 1, 4, 6]  # slot order is rank order: the same rows in the same order
    x = torch.randn(len(slots), 4, 64)
    torch.manual_seed(7)
    ref = _run(layer, slots, "never", x)
    torch.manual_seed(7)
    got = _run(layer, slots, "always", x)
    _assert_close(got, ref, 1e-6)
    torch.manual_seed(8)
    other = _run(layer, slots, "always", x)
    assert not torch.allclose(other[0], got[0])  # dropout really ran


def test_base_only_batches_skip_the_delta() -> None:
    layer = _layer(torch.float32)
    x = torch.randn(3, 2, 64)
    layer.grouped_mm = "always"
    layer.router = Router(torch.zeros(3, dtype=torch.long))
    assert torch.equal(layer(x), layer.base_layer(x))


def test_the_grouped_path_runs_one_pair_of_matmuls_per_rank(monkeypatch) -> None:
    """Slot order 1, 3, 4, 5, 6 has ranks 8, 64, 16, (none here), 16: four runs; ordered by
    rank (slot 5's adapter is rank 32) the two rank-16 slots are adjacent: three."""
    calls: list[int] = []
    real = grouped_lora.reference_grouped_mm
    monkeypatch.setattr(lora, "reference_grouped_mm", lambda *a: calls.append(1) or real(*a))
    layer = _layer(torch.float32)
    slots = ROUTINGS["an untargeted slot"]
    _run(layer, slots, "always", torch.randn(len(slots), 2, 64))
    assert len(calls) == 2 * 3


def test_ranked_routing_orders_groups_by_rank() -> None:
    ids = torch.tensor([1, 3, 0, 2, 1, 3, 2])
    plan = Routing.build(ids, {1: 64, 2: 8, 3: 8})
    ranked = plan.ranked()
    assert ranked is plan.ranked()  # once per routing
    assert ranked.slot_list == (2, 3, 1) and ranked.slots.tolist() == [2, 3, 1]
    assert ranked.rows.tolist() == [3, 6, 1, 5, 0, 4] and not ranked.in_order
    assert ranked.row_slots.tolist() == [2, 2, 3, 3, 1, 1]
    assert ranked.starts == (0, 2, 4, 6) and ranked.slot_set == plan.slot_set
    assert Routing.build(ids, {1: 8, 2: 8, 3: 64}).ranked().slot_list == (1, 2, 3)
    in_rank_order = Routing.build(ids, {1: 8, 2: 8, 3: 8})
    assert in_rank_order.ranked() is in_rank_order


def test_routing_precomputes_the_grouped_offsets() -> None:
    plan = Routing.build(torch.tensor([2, 0, 1, 1, 3, 2, 2]))
    assert plan.slot_list == (1, 2, 3) and plan.counts == (2, 3, 1)
    assert plan.starts == (0, 2, 5, 6)
    assert plan.row_slots.tolist() == [1, 1, 2, 2, 2, 3]
    offs = plan.token_offs(1, 3, tokens=4)  # groups 2 and 3, 4 tokens a row
    assert offs.dtype == torch.int32 and offs.tolist() == [12, 16]
    assert plan.token_offs(1, 3, tokens=4) is offs  # once per routing, for every layer


# ---- FLOPs --------------------------------------------------------------------------


def test_delta_flops_count_what_each_path_multiplies() -> None:
    """The arithmetic against torch's FLOP counter on both real computations."""
    layer = _layer(torch.float32)
    slots = torch.tensor(ROUTINGS["sparse with base rows"])
    plan = Routing.build(slots)
    ranks = [layer.rank_of(s) for s in plan.slot_list]
    want = delta_flops(plan, ranks, tokens=5, shapes=(64, 48, 64))
    x = torch.randn(len(slots), 5, 64)
    for mode, path in (("never", "bmm"), ("always", "grouped")):
        layer.grouped_mm = mode
        with FlopCounterMode(display=False) as counter:
            layer.routed_delta(x, plan)
        assert counter.get_total_flops() == want[path], path
    assert want["grouped"] < want["bmm"]


# ---- gradient checkpointing ------------------------------------------------------------

MIXED = {
    "wide": LoRAConfig(rank=16, alpha=16.0, target_modules=("q_proj", "v_proj", "up_proj")),
    "narrow": LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "down_proj")),
    "mid": LoRAConfig(rank=8, alpha=8.0, target_modules=("v_proj", "o_proj", "up_proj")),
}


def _mixed_model(model_dir, mode: str) -> MultiLoRAModel:
    model = MultiLoRAModel(load_base(model_dir), 4, 16, grouped_mm=mode)
    for i, (name, cfg) in enumerate(MIXED.items()):
        model.add_adapter(name, cfg, seed=i)
        randomise_b(model, name, seed=10 + i)
    return model


def _model_grads(model_dir, mode: str, checkpointing: bool):
    model = _mixed_model(model_dir, mode)
    ids = torch.randint(4, 200, (5, 7), generator=torch.Generator().manual_seed(0))
    slots = torch.tensor([3, 1, 0, 2, 1])
    with gradient_checkpointing(model, enabled=checkpointing):
        logits = model(input_ids=ids, slot_ids=slots).logits
        logits.float().square().mean().backward()  # outside ``route``: the recompute
    return {n: model.adapter_views(n, lambda p: p.grad) for n in MIXED}


def test_checkpointed_grouped_path_gives_the_plain_bmm_gradients(tiny_model_dir, monkeypatch):
    """The recompute in backward runs the grouped path again, under the forward's routing."""
    calls: list[int] = []
    real = grouped_lora.grouped_delta
    monkeypatch.setattr(lora, "grouped_delta", lambda *a: calls.append(1) or real(*a))
    ref = _model_grads(tiny_model_dir, "never", False)
    assert calls == []
    got = _model_grads(tiny_model_dir, "always", True)
    forwards = len(calls)
    for name, grads in ref.items():
        for key, g in grads.items():
            assert g.abs().sum() > 0, (name, key)
            assert torch.allclose(got[name][key], g, atol=1e-6, rtol=1e-5), (name, key)
    once = []
    monkeypatch.setattr(lora, "grouped_delta", lambda *a: once.append(1) or real(*a))
    _model_grads(tiny_model_dir, "always", False)
    assert forwards == 2 * len(once) > 0  # every grouped layer ran again in the recompute


# ---- the fused kernel ------------------------------------------------------------------

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in (9, 10)


@pytest.mark.skipif(not SM90, reason="needs a CUDA sm90/sm100 GPU")
@pytest.mark.parametrize("routing", ROUTINGS)
def test_the_fused_kernel_equals_bmm_on_the_gpu(routing) -> None:
    layer = _layer(BF16, device="cuda")
    assert layer.path(BF16) == "grouped"
    x = torch.randn(len(ROUTINGS[routing]), 5, 64, device="cuda", dtype=BF16)
    ref = _run(layer, ROUTINGS[routing], "never", x)
    got = _run(layer, ROUTINGS[routing], "auto", x)
    _assert_close(got, ref, 2e-2)


# ---- the engine's setting ------------------------------------------------------------


def test_the_engine_trains_on_the_grouped_path_when_told(tiny_model_dir, tmp_path) -> None:
    """``--lora-kernel grouped`` on a CPU: every layer (the lm_head's per-token routing in
    the chunked log-probs included) runs the grouped algorithm through a real tick."""
    from tests.support.engine_builders import engine, spec

    with pytest.raises(ValueError, match="lora_kernel must be one of"):
        engine(tiny_model_dir, tmp_path, lora_kernel="cutlass")
    eng = engine(tiny_model_dir, tmp_path, lora_kernel="grouped")
    assert {layer.grouped_mm for layer in eng.model.lora_layers.values()} == {"always"}
    calls: list[int] = []
    real = grouped_lora.grouped_delta
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lora, "grouped_delta", lambda *a: calls.append(1) or real(*a))
        eng.put_experiment("default.a", spec(steps=2), "default", "a")
        assert eng.tick() is not None
    assert calls  # the grouped path really ran
    status = eng.get_experiment("default.a")
    assert status.error is None and status.step == 1 and status.train_tokens > 0
