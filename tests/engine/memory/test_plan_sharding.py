"""The planner's sharded base (issue 17) and its cut-layer extrapolation: FSDP2's
``fully_shard`` runs for real on a fake process group under fake tensors, and what the
tracker sees follows from the shapes and agrees with the arithmetic."""

from __future__ import annotations

import pytest
import torch
from loraplex_engine.lora.model import MultiLoRAModel
from loraplex_engine.memory.capacity_plan import static_bytes
from loraplex_engine.memory.fake_model import with_layers
from loraplex_engine.memory.plan_sharding import (
    fake_world,
    fsdp_groups,
    shard_base,
    sharded_rank_bytes,
    unsharded_reserve,
)
from loraplex_engine.memory.planner import Workload, extrapolate, load_config, plan
from loraplex_engine.memory.tracker import LiveBytes, storage_bytes
from transformers import AutoModelForCausalLM

SMALL = dict(prompts_per_tenant=2, completions_per_prompt=2, prompt_tokens=6,
             completion_tokens=10, micro_batch_tokens=40)  # fmt: skip


def _deeper(tiny_model_dir, layers: int = 4):
    config = with_layers(load_config(tiny_model_dir), 2)
    config.num_hidden_layers = layers  # the tiny model's layers are alike: more of them
    return config


# The engine's whole step planned on fake tensors, four times over (10-30 s each on 2
# cores): slow, so make test runs it and make test-unit does not.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("sharded", "checkpointing", "depths"),
    [(False, False, (2, 3)), (True, True, (3, 4))],
    ids=["one-gpu", "sharded"],
)
def test_cut_layers_extend_to_the_full_depth(tiny_model_dir, sharded, checkpointing, depths):
    """Measured on two cut depths and extended to 5 layers == measured on all 5. (Under
    FSDP a 2-layer cut is another regime: both layers are in flight at once.)"""
    kw = dict(world_size=4, shard_base=True) if sharded else {}
    work = Workload(adapters=3, rank=4, checkpointing=checkpointing, **SMALL, **kw)
    config = _deeper(tiny_model_dir, 5)
    full = plan(config, work, 2**30)
    cut = plan(config, work, 2**30, cut_layers=depths)
    assert cut["detail"]["measured_layers"] == list(depths)
    assert full["detail"]["measured_layers"] == 5
    assert cut["peak_bytes"] == full["peak_bytes"]
    for key in ("train_flops", "floor_flops"):
        assert cut[key] == pytest.approx(full[key], rel=1e-9)
    assert cut["detail"]["train_total"] == full["detail"]["train_total"]


@pytest.mark.slow  # the planner's step on fake tensors, per rank: 10-20 s on 2 cores
def test_a_sharded_rank_holds_its_shard_every_slot_and_its_share_of_rows(tiny_model_dir):
    config = _deeper(tiny_model_dir)
    work = dict(adapters=4, rank=4, checkpointing=True, **SMALL)
    one = plan(config, Workload(**work), 2**30)
    ranks = plan(config, Workload(**work, world_size=4, shard_base=True), 2**30)
    assert ranks["world_size"] == 4 and one["world_size"] == 1
    base, shard = one["peak_bytes"]["base"], ranks["peak_bytes"]["base"]
    # Sharded over 4 ranks (FSDP pads dim 0 to a multiple of 4): the decoder layers and
    # the body (embeddings, norm). Whole on every rank: the head (the engine keeps it
    # replicated) and the rotary buffers.
    head = config.vocab_size * config.hidden_size * 2  # bf16
    body = head + config.hidden_size * 2  # the embeddings are as big, + the final norm
    rotary = 128
    layer = (base - head - body - rotary) // 4
    arithmetic = sharded_rank_bytes(base, [layer] * 4, [body], 4)
    assert arithmetic["shard"] == (base - head - rotary) // 4 + head + rotary
    assert abs(shard - arithmetic["shard"]) <= 4096  # FSDP pads per parameter, not group
    # LoRA slots, their gradients and Adam moments are replicated, not sharded.
    assert ranks["peak_bytes"]["adapters"] == one["peak_bytes"]["adapters"]
    # 4 tenants x 2 prompt groups over 4 ranks: two groups (4 rows) each.
    assert (one["detail"]["rank_rows"], ranks["detail"]["rank_rows"]) == (16, 4)
    assert ranks["peak_bytes"]["kv_cache"] * 4 == one["peak_bytes"]["kv_cache"]
    assert ranks["train_flops"] == pytest.approx(one["train_flops"] / 4, rel=1e-6)
    assert ranks["floor_flops"] == pytest.approx(one["floor_flops"] / 4, rel=1e-6)
    # FSDP's unsharded copies at the training peak: the body (the root, kept unsharded
    # through forward and backward) and at most two decoder layers.
    gathered = ranks["peak_bytes"]["all_gather"]
    assert body <= gathered <= arithmetic["all_gather"] + 4096  # + FSDP's padding
    assert one["peak_bytes"]["all_gather"] == 0
    assert ranks["peak_bytes"]["total"] < one["peak_bytes"]["total"]


def test_sharded_rank_bytes_arithmetic() -> None:
    # Layers of 10, 7 and 4 bytes, roots of 6 and 2, over 4 ranks: 3 + 2 + 1 + 2 + 1
    # bytes (rounded up), plus 5 bytes no group holds; the roots and the two largest
    # layers unsharded at once.
    assert sharded_rank_bytes(34, [10, 7, 4], [6, 2], 4) == {"shard": 14, "all_gather": 25}
    assert sharded_rank_bytes(34, [10, 7, 4], [6, 2], 4, in_flight=1)["all_gather"] == 18
    assert sharded_rank_bytes(34, [10, 7, 4], [6, 2], 1) == {"shard": 34, "all_gather": 0}
    with pytest.raises(ValueError, match="more than the base"):
        sharded_rank_bytes(20, [10, 7, 4], [], 4)
    # What the engine reserves: the roots and the largest layer, twice (all-gather output
    # and the parameters copied out of it); nothing for a base that is not sharded.
    assert unsharded_reserve([10, 7, 4], [6, 2]) == 36
    assert unsharded_reserve([], []) == 0
    with pytest.raises(ValueError, match="world_size"):
        sharded_rank_bytes(26, [10], [], 0)


def test_extrapolate_extends_what_grows_and_keeps_what_does_not() -> None:
    low = {"bytes": 100, "rows": 8, "by_tag": {"logits": 4}, "flops": 1.5, "fits": True}
    high = {"bytes": 130, "rows": 8, "by_tag": {"logits": 4, "all_gather": 6}, "flops": 2.0,
            "fits": False}  # fmt: skip
    out = extrapolate(low, high, 2, 3, 10)
    assert out == {"bytes": 340, "rows": 8, "by_tag": {"logits": 4, "all_gather": 48},
                   "flops": 5.5, "fits": True}  # fmt: skip
    assert isinstance(out["bytes"], int)


def test_workload_refuses_a_sharded_base_on_one_rank() -> None:
    with pytest.raises(ValueError, match="shard_base"):
        Workload(adapters=1, rank=4, shard_base=True)
    with pytest.raises(ValueError, match="world_size"):
        Workload(adapters=1, rank=4, world_size=0)


def test_tracker_counts_storage_resizes_and_tags() -> None:
    """FSDP frees and re-allocates its all-gather buffers with ``UntypedStorage.resize_``,
    which no dispatch mode sees; the tracker wraps it while it is on."""
    original = torch.UntypedStorage.resize_
    with LiveBytes(track_resize=True) as tracker:
        with tracker.tagging("all_gather"):
            buffer = torch.empty(1000)
        other = torch.empty(10)
        assert tracker.by_tag == {"all_gather": 4000, "other": 40}
        buffer.untyped_storage().resize_(0)
        assert tracker.live == 40 and tracker.by_tag["all_gather"] == 0
        buffer.untyped_storage().resize_(400)
        assert tracker.live == 440
        del buffer, other
        assert tracker.live == 0
    assert torch.UntypedStorage.resize_ is original
    assert tracker.peaks["default"].bytes == 4040


def test_storage_bytes_of_a_sharded_parameter_is_the_ranks_shard() -> None:
    """What capacity_plan.static_bytes reads off a sharded engine's base: its shard."""
    from torch.distributed.fsdp import fully_shard

    with fake_world(4) as mesh:
        layer = torch.nn.Linear(64, 64, bias=False)
        fully_shard(layer, mesh=mesh)
        assert storage_bytes([layer.weight]) == 64 * 64 * 4 // 4
        with pytest.raises(RuntimeError, match="already initialised"), fake_world(2):
            pass
    with fake_world(1) as none:
        assert none is None


def test_the_engines_static_bytes_of_a_sharded_base(tiny_model_dir) -> None:
    """capacity_plan.static_bytes on a base FSDP has sharded (real tensors, fake process
    group): the rank's shards and the whole head, plus the root and one decoder layer
    held twice (all-gather output and parameters: plan_sharding.unsharded_reserve)."""
    config = _deeper(tiny_model_dir, 4)
    hidden, vocab, inter = config.hidden_size, config.vocab_size, config.intermediate_size
    kv = config.num_key_value_heads * config.head_dim
    layer = 4 * (hidden * (2 * hidden + 2 * kv) + 3 * hidden * inter + 2 * hidden)  # fp32
    roots = [4 * (vocab * hidden + hidden)]  # the body: embeddings + norm (the head: whole)
    with fake_world(4) as mesh:
        model = MultiLoRAModel(AutoModelForCausalLM.from_config(config), 2, 4)
        unsharded = static_bytes(model)
        shard_base(model, mesh)
        assert fsdp_groups(model.base_model) == ([layer] * 4, roots)
        sharded = static_bytes(model)
        base = model.base_model
        lora = {id(p) for m in model.lora_layers.values() for p in (m.lora_A, m.lora_B)}
        shards = storage_bytes([p for p in base.parameters() if id(p) not in lora])
        rotary = storage_bytes([b for n, b in base.named_buffers() if "rotary" in n])
    assert fsdp_groups(MultiLoRAModel(AutoModelForCausalLM.from_config(config), 2, 4)) == ([], [])
    assert shards < unsharded.base / 2
    assert sharded.base == shards + rotary + 2 * (sum(roots) + layer)
    assert sharded.slot == unsharded.slot  # LoRA slots replicated
